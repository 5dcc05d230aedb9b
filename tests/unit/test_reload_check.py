"""`make reload`'s check of a new models file (scripts/reload.py `install`): a model file a
pool child could not open must be refused before anything changes. A reload replaces every
worker's children, and a child that cannot load its models stopped its worker, so a garbage
weights file that passed the check stopped every worker while the reload said "done"."""
from __future__ import annotations

import fcntl
import os
import zipfile

import pytest
import yaml

from scripts.reload import Invalid, install

GOOD = {"quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0}}


def models_file(tmp_path, models: dict):
    target = tmp_path / "models.yaml"
    target.write_text(yaml.safe_dump({"models": GOOD}))
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump({"models": models}))
    return target, new


@pytest.mark.parametrize("make", ["garbage", "empty", "folder"])
def test_a_tensor_model_file_that_is_no_archive_is_refused_and_nothing_changes(tmp_path, make):
    weights = tmp_path / "bad.pt"
    if make == "garbage":
        weights.write_bytes(b"not a TorchScript archive")
    elif make == "empty":
        weights.write_bytes(b"")
    else:
        weights.mkdir()
    target, new = models_file(tmp_path, {**GOOD, "ts": {"kind": "torchscript",
                                                         "path": str(weights),
                                                         "input_shape": [1]}})
    before = target.read_bytes()
    with pytest.raises(Invalid, match=r"models\.ts: .*bad\.pt"):
        install(target, new)
    assert target.read_bytes() == before
    assert not (tmp_path / "models.yaml.previous").exists()


def test_a_tensor_model_file_that_is_an_archive_passes(tmp_path):
    weights = tmp_path / "good.pt"
    with zipfile.ZipFile(weights, "w") as archive:
        archive.writestr("good/data.pkl", b"")
    target, new = models_file(tmp_path, {**GOOD, "ts": {"kind": "torchscript",
                                                         "path": str(weights),
                                                         "input_shape": [1]}})
    assert install(target, new)
    assert "ts" in yaml.safe_load(target.read_text())["models"]


def test_a_second_reload_while_one_runs_is_refused_and_changes_nothing(tmp_path):
    from config import Settings
    from scripts.reload import INVALID, reload

    target, new = models_file(tmp_path, {"quick": {**GOOD["quick"], "version": "2"}})
    before = target.read_bytes()
    said: list[str] = []
    # The first reload, still waiting for the processes, holds the lock beside the file.
    held = os.open(tmp_path / ".models.yaml.reload-lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        result = reload(new, say=said.append, timeout_s=1,
                        settings=Settings(models_file=str(target),
                                          redis_url="redis://127.0.0.1:1/0"))
    finally:
        os.close(held)
    assert result.status == INVALID, said
    assert "another reload" in said[0] and "nothing changed" in said[0]
    assert target.read_bytes() == before
    assert not (tmp_path / "models.yaml.previous").exists()
