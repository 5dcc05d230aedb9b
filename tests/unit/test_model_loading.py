"""Model files: only TorchScript, torch.export archives read without unpickling (and
safetensors for text models); a pickle posing as a model is refused without running anything
it contains."""
from __future__ import annotations

import pickle

import pytest
import torch

from config.models import ModelSpec
from workers.child.handlers.tensor import ExportHandler, TorchScriptHandler


class Exploit:
    def __init__(self, marker: str = "/tmp/iq-pickle-exploit-ran") -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


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
    # torch.jit.load reads a zip archive of TorchScript; a pickle is not one.
    with pytest.raises(RuntimeError, match="failed reading zip archive"):
        TorchScriptHandler(spec(bad), "cpu").initialize()
    assert not os.path.exists(marker)


def test_a_torch_save_of_a_plain_module_is_refused(tmp_path):
    path = tmp_path / "eager.pt"
    torch.save(torch.nn.Linear(2, 2), path)  # pickled Python, not TorchScript
    # A zip archive, but without TorchScript's constants: refused before anything is unpickled.
    with pytest.raises(RuntimeError, match="constants.pkl"):
        TorchScriptHandler(spec(path), "cpu").initialize()


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no TorchScript file"):
        TorchScriptHandler(spec(tmp_path / "nope.pt"), "cpu").initialize()


# -- torch.export -----------------------------------------------------------------------------
def export_spec(path, shape=(4,)) -> ModelSpec:
    return ModelSpec(name="ep", kind="export", queue="ep", path=str(path), input_shape=shape)


def test_an_exported_program_runs_any_batch_size_like_the_model(tmp_path):
    from tests.support.models import build_export_model

    path = build_export_model(tmp_path / "m.pt2")
    handler = ExportHandler(export_spec(path), "cpu")
    handler.initialize()
    direct = torch.export.load(str(path)).module()
    for size in (1, 7):
        x = torch.randn(size, 4)
        assert torch.equal(torch.tensor(handler.predict(x.tolist())), direct(x))


def test_an_export_without_a_dynamic_batch_or_of_another_shape_is_refused(tmp_path):
    model = torch.nn.Linear(4, 2).eval()
    torch.export.save(torch.export.export(model, (torch.randn(2, 4),)), str(tmp_path / "s.pt2"))
    with pytest.raises(ValueError, match="batch dimension is not dynamic"):
        ExportHandler(export_spec(tmp_path / "s.pt2"), "cpu").initialize()
    from tests.support.models import build_export_model

    path = build_export_model(tmp_path / "m.pt2")
    with pytest.raises(ValueError, match=r"shape \[4\].*declares input_shape \[5\]"):
        ExportHandler(export_spec(path, (5,)), "cpu").initialize()


def test_a_pickle_posing_as_pt2_is_not_loaded_and_not_executed(tmp_path):
    marker = tmp_path / "ran"
    bad = tmp_path / "model.pt2"
    bad.write_bytes(pickle.dumps(Exploit(str(marker))))
    with pytest.raises(ValueError, match="not a torch.export archive"):
        ExportHandler(export_spec(bad), "cpu").initialize()
    assert not marker.exists()


def test_a_pt2_smuggling_a_pickle_inside_is_refused_without_running_it(tmp_path):
    """torch.export.load itself retries a piece that weights_only refuses with a full
    unpickle (torch 2.13): a real archive whose sample inputs were swapped for a pickle."""
    import io
    import zipfile

    from tests.support.models import build_export_model

    marker = tmp_path / "ran"
    good = build_export_model(tmp_path / "m.pt2")
    payload = io.BytesIO()
    torch.save((Exploit(str(marker)), {}), payload)
    bad = tmp_path / "bad.pt2"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
        for item in src.infolist():
            swap = item.filename.endswith("sample_inputs/model.pt")
            dst.writestr(item, payload.getvalue() if swap else src.read(item.filename))
    with pytest.raises(Exception, match="Weights only load failed"):
        ExportHandler(export_spec(bad), "cpu").initialize()
    assert not marker.exists()
