"""Configuration shared by the API and the workers: defaults → YAML → environment."""
from config.models import ModelSpec, load_models
from config.settings import ConfigError, Settings, load_settings

__all__ = ["ConfigError", "ModelSpec", "Settings", "load_models", "load_settings"]
