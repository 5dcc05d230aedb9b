"""Configuration shared by the API and the workers: defaults → YAML → environment."""
from config.models import ModelSpec, load_models
from config.settings import ConfigError, Settings, check_metrics_folder, load_settings, \
    start_unless_metrics_folder_fails

__all__ = ["ConfigError", "ModelSpec", "Settings", "check_metrics_folder", "load_models",
           "load_settings", "start_unless_metrics_folder_fails"]
