"""Model handlers by kind: each kind of config/kinds.py's registry names its handler class
("package.module:Class"), imported here, in the pool child that loads the model, so that a
worker serving only one kind loads only its dependencies."""
from __future__ import annotations

from kombu.utils.imports import symbol_by_name

from config.kinds import kind_of
from config.models import ModelSpec
from workers.child.handlers.base import Handler


def handler_class(kind: str) -> type[Handler]:
    """The handler class the registered kind `kind` names; ValueError when there is no such
    kind or its handler is not a Handler."""
    try:
        path = kind_of(kind).handler
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    found = symbol_by_name(path)
    if not (isinstance(found, type) and issubclass(found, Handler)):
        raise ValueError(f"kind {kind}: handler {path} is not a subclass of "
                         f"workers.child.handlers.base.Handler")
    return found


def build_handler(spec: ModelSpec, device: str) -> Handler:
    return handler_class(spec.kind)(spec, device)
