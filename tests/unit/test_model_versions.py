"""A model's version: declared, or a short hash of its weights' contents and its settings, with
each file's digest cached by path, size, modification time and inode."""
from __future__ import annotations

import os
import shutil

import pytest
import yaml

from config import ConfigError
from config.models import load_models, read_models
from workers.child import versions
from workers.child.versions import model_version


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _spec(folder, entry):
    path = folder / "models.yaml"
    path.write_text(yaml.safe_dump({"models": {"m": entry}}))
    return load_models(path)["m"]


def _weights(folder, content=b"weights-1"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.pt").write_bytes(content)
    return folder / "model.pt"


TS = {"kind": "torchscript", "path": "model.pt", "input_shape": [4]}


def test_a_declared_version_is_the_version(tmp_path):
    _weights(tmp_path)
    assert model_version(_spec(tmp_path, {**TS, "version": "2024-06-r3"})) == "2024-06-r3"
    assert model_version(_spec(tmp_path, {**TS, "version": 7})) == "7"


@pytest.mark.parametrize("bad", ["", "  ", True, [1]])
def test_a_version_must_be_a_non_empty_string(tmp_path, bad):
    _weights(tmp_path)
    with pytest.raises(ConfigError, match="models.m: version must be a non-empty string"):
        _spec(tmp_path, {**TS, "version": bad})


def test_the_version_follows_the_weights_contents_not_their_place_or_time(tmp_path):
    weights = _weights(tmp_path / "a")
    first = model_version(_spec(tmp_path / "a", TS))
    assert len(first) == versions.VERSION_CHARS
    os.utime(weights, ns=(1, 1))  # touched: same contents, same version
    assert model_version(_spec(tmp_path / "a", TS)) == first
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # another folder (another host)
    assert model_version(_spec(tmp_path / "b", TS)) == first
    weights.write_bytes(b"weights-2")  # new weights: a new version
    assert model_version(_spec(tmp_path / "a", TS)) != first


def test_the_version_follows_the_entry_settings(tmp_path):
    _weights(tmp_path)
    assert model_version(_spec(tmp_path, TS)) != \
        model_version(_spec(tmp_path, {**TS, "max_batch_size": 8}))


def test_every_file_of_a_model_folder_counts(tmp_path):
    folder = tmp_path / "encoder"
    _weights(folder / "1_Pooling")
    (folder / "config.json").write_text("{}")
    entry = {"kind": "synthetic"}  # a kind without files: only its settings count
    spec = _spec(tmp_path, entry)
    assert versions.weight_digests(spec) == []
    spec = _spec(tmp_path, {"kind": "embedding", "path": "encoder"})
    names = [name for name, _ in versions.weight_digests(spec)]
    assert names == ["1_Pooling/model.pt", "config.json"]
    before = model_version(spec)
    (folder / "config.json").write_text('{"hidden_size": 8}')
    assert model_version(spec) != before


def test_a_files_digest_is_read_from_the_cache_while_the_file_is_unchanged(tmp_path):
    weights = _weights(tmp_path)
    real = versions.file_digest(weights)
    [cached] = (tmp_path / "cache" / "inference-queue" / "digests").iterdir()
    assert cached.read_text() == real
    cached.write_text("from-the-cache")
    assert versions.file_digest(weights) == "from-the-cache"
    weights.write_bytes(b"other weights")  # size and mtime change: hashed again
    assert versions.file_digest(weights) not in (real, "from-the-cache")


def test_a_models_files_revision_is_a_hash_of_its_bytes(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump({"models": {"m": {"kind": "synthetic"}}}))
    _, first = read_models(path)
    path.write_text(path.read_text() + "# a comment\n")
    _, second = read_models(path)
    assert first != second and len(first) == 12


def test_a_models_file_that_is_not_yaml_is_a_config_error(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text("models: {m: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_models(path)
