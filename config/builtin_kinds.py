"""The kinds the service ships, registered in config/kinds.py's registry: each one's keys
checked, its input and options for the API, and the handler a pool child loads it with
(workers/child/handlers/)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from config.checks import ConfigError
from config.kinds import Kind, register
from config.preprocess import parse_preprocess
from config.values import (MOST_OUTPUT_FLOATS, folder_labels, labels, model_file, non_negative,
                           positive_int, resolve_path, tensor_input)


def _package_or_path(where: str, kind: str, raw: Mapping[str, Any],
                     base: Path) -> dict[str, Any]:
    """A text model's folder: shipped by a Python package, or at a path."""
    if bool(raw.get("package")) == bool(raw.get("path")):
        raise ConfigError(f"{where}: kind {kind} needs `package` (the package that ships "
                          f"it) or `path` (a Hugging Face folder), not both")
    if raw.get("package"):
        return {"package": str(raw["package"])}
    return {"path": resolve_path(str(raw["path"]), base)}


def _embedding(where: str, raw: Mapping[str, Any], base: Path) -> dict[str, Any]:
    return _package_or_path(where, "embedding", raw, base)


def _classification(where: str, raw: Mapping[str, Any], base: Path) -> dict[str, Any]:
    values = _package_or_path(where, "classification", raw, base)
    values["labels"] = labels(where, raw.get("labels"))
    return values


def _sequence_classification(where: str, raw: Mapping[str, Any],
                             base: Path) -> dict[str, Any]:
    if not raw.get("path") or raw.get("package"):
        raise ConfigError(f"{where}: kind sequence-classification needs `path` (a Hugging "
                          f"Face folder), not `package`")
    path = resolve_path(str(raw["path"]), base)
    return {"path": path, "labels": folder_labels(Path(path))}


def _tensor(kind: str, what: str):
    def parse(where: str, raw: Mapping[str, Any], base: Path) -> dict[str, Any]:
        return {"path": model_file(where, kind, dict(raw), base, what),
                **tensor_input(where, dict(raw))}
    return parse


def _image(where: str, raw: Mapping[str, Any], base: Path) -> dict[str, Any]:
    return {"path": model_file(where, "image", dict(raw), base,
                               "a torch.export .pt2 or TorchScript file"),
            "labels": labels(where, raw.get("labels")),
            "preprocess": parse_preprocess(f"{where}.preprocess", raw.get("preprocess"))}


def _synthetic(where: str, raw: Mapping[str, Any], base: Path) -> dict[str, Any]:
    # Files of the fault tests: every input run is appended to runs_log; a loading child waits
    # while load_gate exists.
    values: dict[str, Any] = {key: resolve_path(str(raw[key]), base)
                              for key in ("runs_log", "load_gate") if raw.get(key)}
    # The child's own work a real model has (the GPU-faithful stand-in): only where set, so
    # that a model without them keeps its version.
    if "prepare_ms" in raw:
        values["prepare_ms"] = non_negative(where, "prepare_ms", raw["prepare_ms"])
    if "output_floats" in raw:
        values["output_floats"] = positive_int(where, "output_floats", raw["output_floats"],
                                               MOST_OUTPUT_FLOATS)
    return values


TEXT = "workers.child.handlers.text"
TENSOR = "workers.child.handlers.tensor"

BUILTIN = (
    Kind("embedding", "text", f"{TEXT}:EmbeddingHandler", _embedding, vectors=True,
         quantizable=True,
         description="a sentence-transformers / Hugging Face folder: one vector per text"),
    Kind("classification", "text", f"{TEXT}:ClassificationHandler", _classification,
         options=("labels",), quantizable=True,
         description="zero-shot: each text against the labels' embeddings"),
    Kind("sequence-classification", "text", f"{TEXT}:SequenceClassificationHandler",
         _sequence_classification, quantizable=True,
         description="a Hugging Face sequence classifier: its labels' scores per text"),
    Kind("torchscript", "tensor", f"{TENSOR}:TorchScriptHandler",
         _tensor("torchscript", "a TorchScript file"), archive=True,
         description="a TorchScript .pt file over tensors of input_shape"),
    Kind("export", "tensor", f"{TENSOR}:ExportHandler",
         _tensor("export", "a torch.export .pt2 file"), archive=True,
         description="a torch.export .pt2 program over tensors of input_shape"),
    Kind("image", "image", "workers.child.handlers.image:ImageHandler", _image,
         options=("top_k",), archive=True,
         description="a .pt2 or .pt image classifier: its top_k labels per picture"),
    Kind("synthetic", "text", f"{TENSOR}:SyntheticHandler", _synthetic,
         keys=("prepare_ms", "output_floats"),
         description="sleeps base_ms + per_item_ms per item (benchmarks, fault tests); with "
                     "prepare_ms and output_floats, a GPU model's CPU work as well"),
)

for _kind in BUILTIN:
    register(_kind)
