"""One value of a models file checked: what config/models.py checks for every model and each
kind's own parse (config/builtin_kinds.py, or a kind of the operator's own) checks for its
keys. Every error names the model, the key and the value it got."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from config.checks import ConfigError

INPUT_DTYPES = ("float32", "float64", "int64")


# The most items of one model call, and floats of one stand-in output: a models file's
# `max_batch_size: 100000000000` (the outside attack of session 13) had each new child build
# that many warm-up inputs, and a stand-in's `output_floats` as large, that many per item.
MOST_BATCH = 65_536  # sixteen times the largest batch the calibrator tries by default
MOST_OUTPUT_FLOATS = 65_536


def shortened(text: str, most: int) -> str:
    """`text` in at most `most` characters, said to be cut (a value or an error quoted in a
    one-line message)."""
    return text if len(text) <= most else text[:most - 1] + "…"


def positive_int(where: str, key: str, value: Any, most: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {key} must be an integer >= 1, got {value!r}")
    if most is not None and value > most:
        raise ConfigError(f"{where}: {key} must be an integer from 1 to {most}, got {value!r}")
    return value


def non_negative(where: str, key: str, value: Any) -> float:
    # NaN passes `< 0` and infinity every bound: YAML's .nan and .inf are floats, and a stand-in
    # given `base_ms: .nan` failed every job of its model while the reload said done.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 \
            or not math.isfinite(value):
        raise ConfigError(f"{where}: {key} must be a finite number >= 0, got {value!r}")
    return float(value)


def one_of(where: str, key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(f"{where}: {key} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def resolve_path(raw: str, base: Path) -> str:
    """An absolute path, links kept (make run's model-file check judges the links too)."""
    return os.path.abspath(base / Path(raw).expanduser())


def labels(where: str, raw: Any) -> tuple[str, ...]:
    found = raw or []
    if not isinstance(found, list) or not all(isinstance(x, str) and x for x in found):
        raise ConfigError(f"{where}: labels must be a list of non-empty strings")
    return tuple(found)


def folder_labels(folder: Path) -> tuple[str, ...]:
    """A classifier's labels, from its folder's config.json (`id2label`), in index order; none
    when this process cannot read the folder (the API may run where the weights are not)."""
    try:
        id2label = json.loads((folder / "config.json").read_text()).get("id2label") or {}
        return tuple(str(id2label[k]) for k in sorted(id2label, key=int))
    except (OSError, ValueError, TypeError):
        return ()


def model_file(where: str, kind: str, raw: dict[str, Any], base: Path, what: str) -> str:
    if not raw.get("path"):
        raise ConfigError(f"{where}: kind {kind} needs `path` ({what})")
    return resolve_path(str(raw["path"]), base)


def tensor_input(where: str, raw: dict[str, Any]) -> dict[str, Any]:
    shape = raw.get("input_shape")
    if not isinstance(shape, list) or not shape:
        raise ConfigError(f"{where}: input_shape must be a non-empty list of integers >= 1")
    return {"input_shape": tuple(positive_int(where, "input_shape[]", d) for d in shape),
            "input_dtype": one_of(where, "input_dtype", raw.get("input_dtype", "float32"),
                                  INPUT_DTYPES)}
