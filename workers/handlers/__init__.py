"""Model handlers by kind (see config/models.yaml)."""
from __future__ import annotations

from config.models import ModelSpec
from workers.handlers.base import Handler


def handler_class(kind: str) -> type[Handler]:
    # Imported on demand so that a worker serving only one kind loads only its dependencies.
    if kind == "embedding":
        from workers.handlers.text import EmbeddingHandler
        return EmbeddingHandler
    if kind == "classification":
        from workers.handlers.text import ClassificationHandler
        return ClassificationHandler
    if kind == "sequence-classification":
        from workers.handlers.text import SequenceClassificationHandler
        return SequenceClassificationHandler
    if kind == "torchscript":
        from workers.handlers.tensor import TorchScriptHandler
        return TorchScriptHandler
    if kind == "export":
        from workers.handlers.tensor import ExportHandler
        return ExportHandler
    if kind == "image":
        from workers.handlers.image import ImageHandler
        return ImageHandler
    if kind == "synthetic":
        from workers.handlers.tensor import SyntheticHandler
        return SyntheticHandler
    raise ValueError(f"unknown model kind {kind!r}")


def build_handler(spec: ModelSpec, device: str) -> Handler:
    return handler_class(spec.kind)(spec, device)
