"""The registry of model kinds: what a models file's `kind:` may name, and for each kind what
every process needs of it.

- config reads its keys (`keys`, checked by `parse`) into the model's ModelSpec;
- the API builds a job's schema, and the OpenAPI document, from its `input` and `options`
  (app/schemas.py);
- a worker's pool child imports its `handler` ("package.module:Class", a subclass of
  workers.child.handlers.base.Handler) and loads the model with it
  (workers/child/handlers/__init__.py).

The handler is named, not imported, so that the API and a worker's main process, which read
every kind, never import a kind's model code (nor torch). The shipped kinds register in
config/builtin_kinds.py; a kind of your own is a module that calls `register` (with its handler
in a module beside it), named in the models file's `kinds:` list, which each process that
serves or describes models (the API, the worker, make run's and make reload's checks) imports
before it reads the models (docs/extending.md, "A kind of your own"); the deliverer and Flower,
which only route by name and queue, do not (config/models.py `parse_models`).
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from config.checks import ConfigError

# How the API takes one input: a string, a nested list of numbers of the model's input_shape,
# or a picture (decoded, checked and resized by the API before it is queued).
INPUT_TYPES = ("text", "tensor", "image")
# The per-job options the API knows how to check: `labels` (a list of strings, at most the
# model's max_labels) and `top_k` (an integer, 1 to the model's labels or top_k).
OPTIONS = ("labels", "top_k")

Parse = Callable[[str, Mapping[str, Any], Path], dict[str, Any]]
_NAME = re.compile(r"^[a-z][a-z0-9-]*$")
_HANDLER = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _nothing(where: str, raw: Mapping[str, Any], base: Path) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Kind:
    name: str
    input: str
    # "package.module:Class", imported only where the model runs.
    handler: str
    # The model's values from its entry (`where` names it in errors, `base` is where relative
    # paths start): ModelSpec's fields, and this kind's own `keys`.
    parse: Parse = _nothing
    # Keys of its own, beyond ModelSpec's fields: kept in spec.kind_settings.
    keys: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    # Its outputs are vectors: a job may ask for them as base64 (`encoding_format`).
    vectors: bool = False
    # `dtype: int8` (dynamic quantisation of the linear layers) applies to it.
    quantizable: bool = False
    # Its `path` is a zip archive (TorchScript, torch.export): `make reload` refuses a file that
    # is not one before any worker tries to load it.
    archive: bool = False
    description: str = ""

    def check(self) -> None:
        where = f"kind {self.name!r}"
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError(f"{where}: a kind's name is a lower-case letter, then lower-case "
                              "letters, digits or -")
        if self.input not in INPUT_TYPES:
            raise ConfigError(f"{where}: input must be one of {', '.join(INPUT_TYPES)}; "
                              f"got {self.input!r}")
        if not isinstance(self.handler, str) or not _HANDLER.match(self.handler):
            raise ConfigError(f"{where}: handler must be 'package.module:Class'; "
                              f"got {self.handler!r}")
        for option in self.options:
            if option not in OPTIONS:
                raise ConfigError(f"{where}: options must be among {', '.join(OPTIONS)}; "
                                  f"got {option!r}")


_KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    """Add `kind` to the registry (again: nothing changes); another kind of the same name is
    refused."""
    kind.check()
    known = _KINDS.get(kind.name)
    if known is not None and known != kind:
        raise ConfigError(f"kind {kind.name!r} is already registered (handler "
                          f"{known.handler}); a kind of your own needs a name of its own")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind (the tests' own kinds, after the test)."""
    _KINDS.pop(name, None)


def kind_names() -> tuple[str, ...]:
    return tuple(_KINDS)


def kind_of(name: str) -> Kind:
    """The registered kind `name`; KeyError naming the known kinds when there is none."""
    try:
        return _KINDS[name]
    except KeyError:
        raise KeyError(f"unknown model kind {name!r}; known: {', '.join(_KINDS)}") from None


def check_kind_modules(where: str, modules: Any) -> list[str]:
    """A models file's `kinds:` list, checked without importing it."""
    if modules is None:
        return []
    if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
        raise ConfigError(f"{where}: must be a list of module names, got {modules!r}")
    return modules


def import_kind_modules(where: str, modules: Any) -> None:
    """Import each module of a models file's `kinds:` list (each registers its kinds)."""
    for module in check_kind_modules(where, modules):
        try:
            importlib.import_module(module)
        except ConfigError as exc:
            raise ConfigError(f"{where}: module {module!r}: {exc}") from None
        except Exception as exc:
            raise ConfigError(f"{where}: cannot import module {module!r}: "
                              f"{type(exc).__name__}: {exc}") from None
