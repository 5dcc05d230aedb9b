"""The calibrator's answers (scripts/calibrate.py `--save`) as the GPU default batch size.

The calibration file holds, per model, what the calibrator measured on a GPU: the largest batch
that ran, its recommendation (80 % of that: the reference design's rule, headroom for longer
inputs than its samples) and, for a text model, its max sequence length. A model that runs on a
GPU and whose models-file entry leaves `max_batch_size` out takes that recommendation (one
measured on a GPU), capped by
the token budget (`max_batch_tokens` / its max sequence length, text-embeddings-inference's
max-batch-tokens); one on a CPU, or with no answer saved, keeps `max_batch_size`'s default."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from config.models import ModelSpec
from config.checks import ConfigError
from config.settings import Settings
from config.values import MOST_BATCH, shortened

logger = logging.getLogger(__name__)


def calibration_path(settings: Settings) -> Path:
    path = Path(settings.calibration_file)
    return path if path.is_absolute() else Path(settings.models_file).parent / path


def load_calibration(path: Path) -> dict[str, dict[str, Any]]:
    """The answers saved, by model; {} when there is no file."""
    try:
        content = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"calibration_file {path}: cannot be read: {exc}") from None
    try:
        answers = json.loads(content)
    except (ValueError, RecursionError) as exc:  # not UTF-8 (a ValueError), nested too deep
        raise ConfigError(f"calibration_file {path}: not JSON: {exc}") from None
    if not isinstance(answers, dict) or not all(isinstance(v, dict) for v in answers.values()):
        raise ConfigError(f"calibration_file {path}: expected an object of models, each an "
                          f"object")
    return answers


def token_cap(max_batch_tokens: int, max_seq_length: int | None) -> int | None:
    """The most items of max_seq_length tokens a batch may hold; None: not a text model."""
    if not max_seq_length or max_seq_length < 1:
        return None
    return max(1, max_batch_tokens // max_seq_length)


def recommended(largest_safe: int, cap: int | None = None) -> int:
    """80 % of the largest batch that ran, no more than the token cap, at least 1."""
    size = max(1, int(0.8 * largest_safe))
    return size if cap is None else max(1, min(size, cap))


def batch_size_for(spec: ModelSpec, on_gpu: bool, answers: dict[str, dict[str, Any]],
                   max_batch_tokens: int) -> int:
    """The model's max batch: the one its entry declares; on a GPU, the calibrator's answer
    under the token budget; else max_batch_size's default."""
    answer = answers.get(spec.name)
    if spec.batch_size_declared or not on_gpu or not answer \
            or not str(answer.get("device", "")).startswith("cuda"):
        return spec.max_batch_size  # an answer measured on a CPU says nothing of a GPU
    largest, seq = answer.get("largest_safe"), answer.get("max_seq_length")
    # An integer the models file could declare (a file's 10**11 or Infinity, the outside
    # attack of session 14, would have each child warm up on that many items, or stop it).
    if not _integer(largest, 1, MOST_BATCH) or not (seq is None or _integer(seq, 0)):
        raise ConfigError(f"calibration_file: model {spec.name}: expected largest_safe (an "
                          f"integer from 1 to {MOST_BATCH}) and max_seq_length (an integer "
                          f"or null), got {shortened(repr(answer), 200)}")
    return recommended(largest, token_cap(max_batch_tokens, seq))


def _integer(value: Any, least: int, most: int | None = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least \
        and (most is None or value <= most)


def on_gpu(spec: ModelSpec, gpus: int) -> bool:
    """Whether the model runs on a GPU on a host with `gpus` of them (device `cuda`, or `auto`
    where there is one; int8 weights stay on the CPU)."""
    return spec.dtype != "int8" and (spec.device == "cuda" or (spec.device == "auto"
                                                                and gpus > 0))


def effective_batch_size(spec: ModelSpec, settings: Settings, gpu: bool) -> int:
    """The model's max batch as everything that sizes a batch takes it: the worker's batching
    (workers/batching/dispatcher.py), the child's warm-up and chunks (workers/child/runtime.py)
    and the worker's prefetch (tasks/celery_app.py). `gpu`: whether it runs on one
    (`on_gpu`, or the child's device). A calibration file that cannot be read is logged, and
    the model keeps max_batch_size."""
    if not gpu or spec.batch_size_declared:
        return spec.max_batch_size
    path = calibration_path(settings)
    try:
        return batch_size_for(spec, True, load_calibration(path), settings.max_batch_tokens)
    except ConfigError as exc:
        logger.error("%s; model %s keeps max_batch_size %d", exc, spec.name,
                     spec.max_batch_size)
        return spec.max_batch_size


def sized(spec: ModelSpec, settings: Settings, gpu: bool) -> ModelSpec:
    """`spec` with its effective max batch (`effective_batch_size`) as its max_batch_size."""
    size = effective_batch_size(spec, settings, gpu)
    return spec if size == spec.max_batch_size else dataclasses.replace(spec,
                                                                        max_batch_size=size)


def save_answer(path: Path, model: str, answer: dict[str, Any]) -> None:
    """The calibrator's answer for `model` written to the file, beside the others."""
    answers = load_calibration(path)
    answers[model] = answer
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(answers, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
