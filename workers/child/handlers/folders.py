"""Reading a Hugging Face / sentence-transformers folder the way sentence-transformers does:
the tokenizer, the longest sequence, and for encoders the pooling and normalisation its
modules.json declares. Weights are read from safetensors only (never a pickle).
"""
from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config.models import ModelSpec

# sentence-transformers' pooling modes, in the order it concatenates them.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "lasttoken")
_LEGACY_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                   "pooling_mode_mean_tokens": "mean",
                   "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean",
                   "pooling_mode_lasttoken": "lasttoken"}
_MODULES = ("Transformer", "Pooling", "Normalize")


def package_model_dir(package: str) -> Path:
    module = importlib.import_module(package)
    getter = getattr(module, "get_model_path", None)
    path = Path(getter()) if getter else Path(module.__file__).parent / "model"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{package}: no model.safetensors under {path}")
    return path


def model_dir(spec: ModelSpec) -> Path:
    if spec.package:
        return package_model_dir(spec.package)
    path = Path(spec.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {spec.name}: {path} is not a Hugging Face folder "
                                f"(no config.json)")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"model {spec.name}: no .safetensors weights under {path} "
                                f"(pickled .bin weights are not loaded)")
    return path


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


@dataclass(frozen=True)
class EncoderConfig:
    max_seq_length: int
    pooling: tuple[str, ...]
    normalize: bool


def max_seq_length(folder: Path) -> int:
    """sentence_bert_config.json's max_seq_length; else the tokenizer's model_max_length;
    never more than the model's position embeddings."""
    positions = int(_json(folder / "config.json").get("max_position_embeddings") or 512)
    length = _json(folder / "sentence_bert_config.json").get("max_seq_length")
    if not length:
        length = _json(folder / "tokenizer_config.json").get("model_max_length")
        length = length if isinstance(length, int) and length < 1_000_000 else positions
    return min(int(length), positions)


def _pooling(config: dict[str, Any], where: Path) -> tuple[str, ...]:
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _LEGACY_POOLING.items() if config.get(key)]
    modes = [modes] if isinstance(modes, str) else list(modes)
    unsupported = [m for m in modes if m not in POOLING_MODES]
    if unsupported or not modes:
        raise ValueError(f"{where}: pooling {modes or 'none'} is not supported "
                         f"(supported: {', '.join(POOLING_MODES)})")
    return tuple(m for m in POOLING_MODES if m in modes)


def encoder_config(folder: Path) -> EncoderConfig:
    """A sentence-transformers folder's pipeline (modules.json: Transformer → Pooling →
    Normalize?); a plain Hugging Face folder gets mean pooling and no normalisation, as
    sentence-transformers gives it."""
    modules = json.loads((folder / "modules.json").read_text()) \
        if (folder / "modules.json").is_file() else []
    pooling: tuple[str, ...] = ("mean",)
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _MODULES:
            raise ValueError(f"{folder}: module {module.get('type')!r} in modules.json is not "
                             f"supported (only {', '.join(_MODULES)})")
        if kind == "Pooling":
            pooling = _pooling(_json(folder / module.get("path", "") / "config.json"), folder)
        normalize = normalize or kind == "Normalize"
    return EncoderConfig(max_seq_length(folder), pooling, normalize)


def load_tokenizer(folder: Path, max_length: int):
    """A `tokenizers.Tokenizer` truncating at `max_length`, without padding: tokenizer.json
    when the folder has one, else the fast tokenizer transformers builds from its vocabulary."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                                  use_fast=True).backend_tokenizer
    tokenizer.enable_truncation(max_length=max_length)
    tokenizer.no_padding()
    return tokenizer


def load_model(folder: Path, auto_class: str, device: str, dtype: str):
    """transformers' `auto_class` from the folder's safetensors, on `device` (int8: quantised,
    see workers.child.devices.place)."""
    import transformers
    from transformers.utils import logging as transformers_logging

    from workers.child.devices import place, torch_dtype

    # A pool child's stderr goes to Celery's log as WARNING lines, one per redraw of the
    # "Loading weights" bar; the runtime logs one line per model instead.
    transformers_logging.disable_progress_bar()
    model = getattr(transformers, auto_class).from_pretrained(
        str(folder), use_safetensors=True, local_files_only=True, dtype=torch_dtype(dtype))
    return place(model, device, dtype)
