"""Model declarations (`config/models.yaml`): what each model is, where it loads from, its queue,
its batching policy and the limits the API enforces on its inputs.

Read by the API (validation, routing) and by the workers (loading, batching); holds no torch.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

import config.builtin_kinds  # noqa: F401  (the shipped kinds, registered)
from config.groups import GROUP_NAME
from config.kinds import Kind, check_kind_modules, import_kind_modules, kind_names, kind_of
from config.preprocess import IMAGE_FORMATS, IMAGE_SOURCES, ImagePreprocess
from config.settings import CONFIG_DIR, PROJECT_DIR, ConfigError
from config.values import MOST_BATCH, non_negative, one_of, positive_int

# int8: dynamic quantisation of the linear layers, which torch runs on the CPU only.
DTYPES = ("float32", "float16", "bfloat16", "int8")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: str
    queue: str
    max_batch_size: int = 32
    max_wait_ms: float = 5.0
    # Whether the models file names max_batch_size: one left out takes, on a GPU, the
    # calibrator's answer (config/calibration.py).
    batch_size_declared: bool = False
    max_inputs: int = 64
    # Text kinds: `package` (a Python package shipping the model folder) or `path` (a folder).
    package: str = ""
    max_input_chars: int = 10_000
    labels: tuple[str, ...] = ()
    max_labels: int = 32
    # TorchScript (`.pt`) and torch.export (`.pt2`) kinds; also image models (either format).
    path: str = ""
    input_shape: tuple[int, ...] = ()
    input_dtype: str = "float32"
    # Image kind: how a picture becomes the model's input tensor, and what the API accepts.
    preprocess: ImagePreprocess | None = None
    top_k: int = 5
    max_image_bytes: int = 10_485_760
    max_image_pixels: int = 40_000_000
    # Synthetic kind: a batch of n items costs base_ms + per_item_ms * n of sleep. It stands in
    # for a GPU model (a batch costs little more than one item) in benchmarks and fault tests.
    base_ms: float = 20.0
    per_item_ms: float = 0.2
    oom_above: int = 0  # > 0: a call of more items raises CUDA out-of-memory (fault tests)
    # A file to which every input the model is called on is appended, one line each: fault
    # tests count from it how many times each job really ran.
    runs_log: str = ""
    # A file that holds a loading child back while it exists: fault tests keep a replacement
    # child loading (as a real model's load takes seconds) for as long as they need.
    load_gate: str = ""
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
    # Share of the device's memory this model may use; a pool child's cap on a device is the
    # sum over the models it loads there (0: no cap of its own, IQ_CUDA_MEMORY_FRACTION).
    memory_fraction: float = 0.0
    # What the operator calls this model's version; "" (the default): a short hash of its
    # weights and settings, computed where the weights are (workers/child/versions.py).
    version: str = ""
    # The per-job options its kind takes (config/kinds.py OPTIONS).
    options: tuple[str, ...] = field(default=())
    # The Redis group (settings' redis_groups) holding its queue, records and results; "":
    # REDIS_URL's (config/groups.py).
    redis: str = ""
    # The values of its kind's own keys (a kind registered with `keys`: config/kinds.py).
    kind_settings: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def input_type(self) -> str:
        """text, tensor or image: how the API takes one input (its kind's `input`)."""
        return kind_of(self.kind).input

    def input_description(self) -> dict[str, Any]:
        """What one input is: shown by GET /v1/models and in the OpenAPI document."""
        if self.input_type == "text":
            return {"type": "text"}
        if self.input_type == "tensor":
            return {"type": "tensor", "shape": list(self.input_shape), "dtype": self.input_dtype}
        assert self.preprocess is not None
        return {"type": "image", "sources": list(IMAGE_SOURCES),
                "formats": list(IMAGE_FORMATS), "preprocess": self.preprocess.public()}

    def public(self) -> dict[str, Any]:
        """What GET /v1/models shows of this model."""
        limits: dict[str, Any] = {"max_inputs": self.max_inputs}
        if self.input_type == "text":
            limits["max_input_chars"] = self.max_input_chars
        elif self.input_type == "tensor":
            limits["input_shape"] = list(self.input_shape)
            limits["input_dtype"] = self.input_dtype
        else:
            limits["max_image_bytes"] = self.max_image_bytes
            limits["max_image_pixels"] = self.max_image_pixels
        out: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "queue": self.queue,
            "input": self.input_description(),
            "dtype": self.dtype,
            "max_batch_size": self.max_batch_size,
            "max_wait_ms": self.max_wait_ms,
            "max_queue_depth": self.max_queue_depth,
            "timeout_s": self.timeout_s or None,
            "time_limit_s": self.time_limit_s or None,
            "limits": limits,
            "options": list(self.options),
        }
        if self.labels:
            out["labels"] = list(self.labels)
        return out


# Fields that say where a model is or what a test counts, not what it computes: left out of the
# settings a version hashes (its weights' contents stand for its `path` or `package`).
_NOT_DEFINING = ("name", "path", "package", "runs_log", "version", "redis")


def settings_digest(spec: ModelSpec) -> str:
    """A hash of the settings that define what the model computes and how it is served (every
    field but its name, where its weights are and `version`): one of the two halves of a
    version that is not declared."""
    values = {k: v for k, v in asdict(spec).items()
              if k not in _NOT_DEFINING and k != "load_gate"}  # a fault test's, as runs_log
    if not values["kind_settings"]:  # the shipped kinds': their versions as before the field
        del values["kind_settings"]
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def _unimported(raw: dict[str, Any]) -> Kind | None:
    """A stand-in for a kind this process has not registered, the file's `kinds:` modules
    not imported (parse_models' `kinds=False`): it takes every key, and parses none of its
    own."""
    name = raw.get("kind")
    if not isinstance(name, str) or name in kind_names():
        return None
    return Kind(name=name, input="text", handler="config.kinds:Unimported", keys=tuple(raw))


def parse_model(name: str, raw: dict[str, Any], base: Path,
                stand_in: Callable[[dict[str, Any]], Kind | None] | None = None) -> ModelSpec:
    where = f"models.{name}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping")
    kind = (stand_in and stand_in(raw)) or \
        kind_of(one_of(where, "kind", raw.get("kind"), kind_names()))
    known = set(ModelSpec.__dataclass_fields__) - {"name", "options", "kind_settings",
                                                   "batch_size_declared"}
    unknown = set(raw) - known - set(kind.keys)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    values: dict[str, Any] = {"name": name, "kind": kind.name, "options": kind.options,
                              "queue": str(raw.get("queue") or name)}
    for key in ("max_batch_size", "max_inputs", "max_input_chars", "max_labels",
                "max_queue_depth", "oom_above", "top_k", "max_image_bytes",
                "max_image_pixels"):
        if key in raw:
            values[key] = positive_int(where, key, raw[key],
                                       MOST_BATCH if key == "max_batch_size" else None)
    values["batch_size_declared"] = "max_batch_size" in raw
    for key in ("max_wait_ms", "base_ms", "per_item_ms", "timeout_s", "time_limit_s"):
        if key in raw:
            values[key] = non_negative(where, key, raw[key])
    values["device"] = one_of(where, "device", raw.get("device", "auto"), DEVICES)
    values["dtype"] = one_of(where, "dtype", raw.get("dtype", "float32"), DTYPES)
    if values["dtype"] == "int8":
        if not kind.quantizable:
            quantizable = [k for k in kind_names() if kind_of(k).quantizable]
            raise ConfigError(f"{where}: dtype int8 applies to the kinds "
                              f"{', '.join(quantizable)}; got kind {kind.name}")
        if values["device"] == "cuda":
            raise ConfigError(f"{where}: dtype int8 runs on the CPU only; use device: cpu "
                              f"(or auto)")
    fraction = non_negative(where, "memory_fraction", raw.get("memory_fraction", 0.0))
    if fraction > 1:
        raise ConfigError(f"{where}: memory_fraction must be in (0, 1], got {fraction!r}")
    values["memory_fraction"] = fraction
    if "version" in raw:
        version = raw["version"]
        if isinstance(version, bool) or not isinstance(version, (str, int, float)) \
                or not str(version).strip():
            raise ConfigError(f"{where}: version must be a non-empty string, got {version!r}")
        values["version"] = str(version).strip()
    if "redis" in raw:
        values["redis"] = _group(where, raw["redis"])
    values.update(_kind_values(where, kind, raw, base))
    return ModelSpec(**values)


def _kind_values(where: str, kind: Kind, raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """What the kind's own parse makes of the entry: ModelSpec's fields, and the kind's own
    keys gathered in `kind_settings`."""
    fields, own = {}, {}
    for key, value in kind.parse(where, raw, base).items():
        if key in ModelSpec.__dataclass_fields__:
            fields[key] = value
        elif key in kind.keys:
            own[key] = value
        else:
            raise ConfigError(f"{where}: kind {kind.name} set {key!r}, a key it does not "
                              f"declare (Kind.keys)")
    if own:
        fields["kind_settings"] = own
    return fields


def _group(where: str, value: Any) -> str:
    """A model's `redis`: a group's name (whether it is configured is checked against the
    settings: config.groups.check_model_groups)."""
    if not isinstance(value, str) or not GROUP_NAME.match(value):
        raise ConfigError(f"{where}: redis must name a group of redis_groups (a lower-case "
                          f"letter, then lower-case letters, digits or _), got {value!r}")
    return value


def revision_of(content: bytes) -> str:
    """A models file's revision: a short hash of its bytes. A reload announces the revision it
    validated, and each process reloads only a file with that revision (scripts/reload.py)."""
    return hashlib.sha256(content).hexdigest()[:12]


def read_models_content(path: str | Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"models file not found: {path}") from None
    except OSError as exc:  # another user's file (IQ_RUN_USERS=separate), a folder
        raise ConfigError(f"models file {path}: cannot read it: {exc.strerror}") from None


def read_models(path: str | Path, *, kinds: bool = True) -> tuple[dict[str, ModelSpec], str]:
    """A models file's models and its revision, from one read of the file (`kinds`:
    parse_models')."""
    content = read_models_content(path)
    return parse_models(Path(path), content, kinds=kinds), revision_of(content)


def load_models(path: str | Path) -> dict[str, ModelSpec]:
    """Parse a models file; relative model paths are taken from the project root."""
    return read_models(path)[0]


# Where this process's parse_models is done instead, when it may not import the file's
# `kinds:` modules itself (`parse_elsewhere`).
_ELSEWHERE: Callable[[Path, bytes], dict[str, ModelSpec]] | None = None


def parse_elsewhere(parser: Callable[[Path, bytes], dict[str, ModelSpec]] | None) -> None:
    """Have every parse_models of this process (that imports kinds) done by `parser` (None:
    here again): make run and make reload as root with IQ_RUN_USERS=separate, which hand it
    to a process of the worker's user (scripts/models_as_user.py), so that no root process
    imports a `kinds:` module, which is code."""
    global _ELSEWHERE
    _ELSEWHERE = parser


def parse_models(path: Path, content: bytes, *, kinds: bool = True) -> dict[str, ModelSpec]:
    """The models of a file at `path` (its folder is where relative paths start) that holds
    `content`. `kinds=False`: its `kinds:` modules are not imported (a part that only routes
    by name and queue: the deliverer, Flower); a model of a kind they would register is
    read from the keys every model has (name, queue, redis, batching, device), its kind's
    own parse left to the parts that import it (`_unimported`)."""
    if kinds and _ELSEWHERE is not None:
        return _ELSEWHERE(path, content)
    try:
        data = yaml.safe_load(content) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict) or not models:
        raise ConfigError(f"{path}: expected `models:` with at least one model")
    # Kinds of the operator's own: their modules register them before any model names one.
    if kinds:
        import_kind_modules(f"{path}: kinds", data.get("kinds"))
    else:
        check_kind_modules(f"{path}: kinds", data.get("kinds"))
    base = PROJECT_DIR if path.resolve().parent == CONFIG_DIR else path.resolve().parent
    specs = {str(name): parse_model(str(name), raw, base,
                                    None if kinds or not data.get("kinds") else _unimported)
             for name, raw in models.items()}
    queues: dict[str, str] = {}
    for spec in specs.values():
        if spec.queue in queues:
            raise ConfigError(
                f"models.{spec.name}: queue {spec.queue!r} is already used by {queues[spec.queue]}"
            )
        queues[spec.queue] = spec.name
    return specs
