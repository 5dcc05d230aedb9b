"""Model declarations (`config/models.yaml`): what each model is, where it loads from, its queue,
its batching policy and the limits the API enforces on its inputs.

Read by the API (validation, routing) and by the workers (loading, batching); holds no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from config.settings import CONFIG_DIR, PROJECT_DIR, ConfigError

KINDS = ("embedding", "classification", "torchscript", "synthetic")
TEXT_KINDS = ("embedding", "classification", "synthetic")
DTYPES = ("float32", "float16", "bfloat16")
INPUT_DTYPES = ("float32", "float64", "int64")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: str
    queue: str
    max_batch_size: int = 32
    max_wait_ms: float = 5.0
    max_inputs: int = 64
    # Text kinds.
    package: str = ""
    max_input_chars: int = 10_000
    labels: tuple[str, ...] = ()
    max_labels: int = 32
    # TorchScript kind.
    path: str = ""
    input_shape: tuple[int, ...] = ()
    input_dtype: str = "float32"
    # Synthetic kind: a batch of n items costs base_ms + per_item_ms * n of sleep. It stands in
    # for a GPU model (a batch costs little more than one item) in benchmarks and fault tests.
    base_ms: float = 20.0
    per_item_ms: float = 0.2
    oom_above: int = 0  # > 0: a call of more items raises CUDA out-of-memory (fault tests)
    # A file to which every input the model is called on is appended, one line each: fault
    # tests count from it how many times each job really ran.
    runs_log: str = ""
    # Overload and time. A job not started within timeout_s ends `expired` (0: no deadline;
    # a job may set its own). A batch running past time_limit_s is killed, its jobs end
    # `failed` with code `timeout` and the child is replaced (0: no limit). Past
    # max_queue_depth waiting jobs, new ones are refused with 429.
    max_queue_depth: int = 1000
    timeout_s: float = 0.0
    time_limit_s: float = 0.0
    # Placement and numerics.
    device: str = "auto"
    dtype: str = "float32"
    options: tuple[str, ...] = field(default=())

    @property
    def task_name(self) -> str:
        from tasks.names import task_name

        return task_name(self.name)

    def public(self) -> dict[str, Any]:
        """What GET /v1/models shows of this model."""
        limits: dict[str, Any] = {"max_inputs": self.max_inputs}
        if self.kind in TEXT_KINDS:
            limits["max_input_chars"] = self.max_input_chars
        if self.kind == "torchscript":
            limits["input_shape"] = list(self.input_shape)
            limits["input_dtype"] = self.input_dtype
        out: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "queue": self.queue,
            "max_batch_size": self.max_batch_size,
            "max_wait_ms": self.max_wait_ms,
            "max_queue_depth": self.max_queue_depth,
            "timeout_s": self.timeout_s or None,
            "time_limit_s": self.time_limit_s or None,
            "limits": limits,
            "options": list(self.options),
        }
        if self.kind == "classification":
            out["labels"] = list(self.labels)
        return out


def _positive_int(where: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {key} must be an integer >= 1, got {value!r}")
    return value


def _non_negative(where: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{where}: {key} must be a number >= 0, got {value!r}")
    return float(value)


def _one_of(where: str, key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(f"{where}: {key} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _resolve_path(raw: str, base: Path) -> str:
    path = Path(raw).expanduser()
    if not path.is_absolute():
        path = (base / path).resolve()
    return str(path)


def parse_model(name: str, raw: dict[str, Any], base: Path) -> ModelSpec:
    where = f"models.{name}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping")
    known = set(ModelSpec.__dataclass_fields__) - {"name", "options"}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    kind = _one_of(where, "kind", raw.get("kind"), KINDS)
    values: dict[str, Any] = {"name": name, "kind": kind, "queue": str(raw.get("queue") or name)}
    for key in ("max_batch_size", "max_inputs", "max_input_chars", "max_labels",
                "max_queue_depth", "oom_above"):
        if key in raw:
            values[key] = _positive_int(where, key, raw[key])
    for key in ("max_wait_ms", "base_ms", "per_item_ms", "timeout_s", "time_limit_s"):
        if key in raw:
            values[key] = _non_negative(where, key, raw[key])
    if kind == "synthetic" and raw.get("runs_log"):
        values["runs_log"] = _resolve_path(str(raw["runs_log"]), base)
    values["device"] = _one_of(where, "device", raw.get("device", "auto"), DEVICES)
    values["dtype"] = _one_of(where, "dtype", raw.get("dtype", "float32"), DTYPES)

    if kind in ("embedding", "classification"):
        values["package"] = str(raw.get("package") or "")
        if not values["package"]:
            raise ConfigError(f"{where}: kind {kind} needs `package` (the package that ships it)")
    if kind == "classification":
        labels = raw.get("labels") or []
        if not isinstance(labels, list) or not all(isinstance(x, str) and x for x in labels):
            raise ConfigError(f"{where}: labels must be a list of non-empty strings")
        values["labels"] = tuple(labels)
        values["options"] = ("labels",)
    if kind == "torchscript":
        if not raw.get("path"):
            raise ConfigError(f"{where}: kind torchscript needs `path` (a TorchScript file)")
        values["path"] = _resolve_path(str(raw["path"]), base)
        shape = raw.get("input_shape")
        if not isinstance(shape, list) or not shape:
            raise ConfigError(f"{where}: input_shape must be a non-empty list of integers >= 1")
        values["input_shape"] = tuple(_positive_int(where, "input_shape[]", d) for d in shape)
        values["input_dtype"] = _one_of(
            where, "input_dtype", raw.get("input_dtype", "float32"), INPUT_DTYPES
        )
    return ModelSpec(**values)


def load_models(path: str | Path) -> dict[str, ModelSpec]:
    """Parse a models file; relative model paths are taken from the project root."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"models file not found: {path}") from None
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict) or not models:
        raise ConfigError(f"{path}: expected `models:` with at least one model")
    base = PROJECT_DIR if path.resolve().parent == CONFIG_DIR else path.resolve().parent
    specs = {str(name): parse_model(str(name), raw, base) for name, raw in models.items()}
    queues: dict[str, str] = {}
    for spec in specs.values():
        if spec.queue in queues:
            raise ConfigError(
                f"models.{spec.name}: queue {spec.queue!r} is already used by {queues[spec.queue]}"
            )
        queues[spec.queue] = spec.name
    return specs
