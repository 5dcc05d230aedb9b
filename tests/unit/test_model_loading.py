"""Model files: only TorchScript (and safetensors for the packaged text models); a pickle
posing as a model is refused without running anything it contains."""
from __future__ import annotations

import pickle

import pytest
import torch

from config.models import ModelSpec
from workers.handlers.tensor import TorchScriptHandler


class Exploit:
    def __reduce__(self):
        return (open, ("/tmp/iq-pickle-exploit-ran", "w"))


def spec(path) -> ModelSpec:
    return ModelSpec(name="ts", kind="torchscript", queue="ts", path=str(path),
                     input_shape=(2,))


def test_a_pickle_is_not_loaded_and_not_executed(tmp_path):
    marker = "/tmp/iq-pickle-exploit-ran"
    import os

    if os.path.exists(marker):
        os.remove(marker)
    bad = tmp_path / "model.pt"
    bad.write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(Exception):
        TorchScriptHandler(spec(bad), "cpu").initialize()
    assert not os.path.exists(marker)


def test_a_torch_save_of_a_plain_module_is_refused(tmp_path):
    path = tmp_path / "eager.pt"
    torch.save(torch.nn.Linear(2, 2), path)  # pickled Python, not TorchScript
    with pytest.raises(Exception):
        TorchScriptHandler(spec(path), "cpu").initialize()


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no TorchScript file"):
        TorchScriptHandler(spec(tmp_path / "nope.pt"), "cpu").initialize()
