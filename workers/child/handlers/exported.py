"""torch.export programs (`.pt2`, written by `torch.export.save`), loaded without unpickling
arbitrary objects, and checked to take a batch of any size.

`torch.export.load` falls back to `torch.load(weights_only=False)` for pieces it cannot read
as plain tensors, and unpickles "opaque" constants with `pickle.loads`: either would run code
from the file. Here every torch.load is forced to weights_only (torch's own
TORCH_FORCE_WEIGHTS_ONLY_LOAD switch, for the duration of the load) and an archive holding
opaque objects is refused before anything in it is read.
"""
from __future__ import annotations

import os
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


@contextmanager
def _weights_only() -> Iterator[None]:
    before = os.environ.get(_FORCE)
    os.environ[_FORCE] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_FORCE, None)
        else:
            os.environ[_FORCE] = before


def _check_archive(path: Path) -> None:
    from torch.export.pt2_archive.constants import OPAQUE_OBJ_FILENAME_PREFIX

    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile:
        raise ValueError(f"{path} is not a torch.export archive (torch.export.save writes a "
                         f"zip file)") from None
    opaque = [n for n in names if Path(n).name.startswith(OPAQUE_OBJ_FILENAME_PREFIX)]
    if opaque:
        raise ValueError(f"{path} holds pickled Python objects ({opaque[0]}); they are not "
                         f"loaded")


def _check_signature(program, path: Path, input_shape: tuple[int, ...]) -> None:
    """One tensor input of shape (batch, *input_shape) with the batch dimension dynamic."""
    import torch

    user_inputs = program.graph_signature.user_inputs
    values = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
    shapes = [getattr(values.get(name), "shape", None) for name in user_inputs]
    if len(shapes) != 1 or shapes[0] is None:
        raise ValueError(f"{path}: the program must take one tensor, got {len(shapes)} inputs")
    shape = tuple(shapes[0])
    if not shape or not isinstance(shape[0], torch.SymInt):
        raise ValueError(f"{path}: the batch dimension is not dynamic; export with "
                         f"dynamic_shapes={{'x': {{0: torch.export.Dim('batch')}}}}")
    rest = tuple(int(d) if not isinstance(d, torch.SymInt) else None for d in shape[1:])
    if rest != tuple(input_shape):
        raise ValueError(f"{path}: the program takes inputs of shape {list(rest)} after the "
                         f"batch dimension; the model declares input_shape {list(input_shape)}")


def load_exported(path: Path, device: str, input_shape: tuple[int, ...]):
    """The program's module on `device`, ready to call on a (batch, *input_shape) tensor."""
    import torch
    from torch.export.passes import move_to_device_pass

    _check_archive(path)
    with _weights_only():
        program = torch.export.load(str(path))
    _check_signature(program, path, input_shape)
    if device != "cpu":
        program = move_to_device_pass(program, device)
    return program.module()
