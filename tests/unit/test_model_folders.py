"""Hugging Face / sentence-transformers folders read as sentence-transformers reads them:
pooling, normalisation and sequence length come from the folder's own files."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from config.models import ModelSpec
from tests.support.models import minilm_folder
from workers.child.handlers.folders import encoder_config, model_dir
from workers.child.handlers.text import EmbeddingHandler

TEXTS = ["A cat sat on the mat.", "", " ".join(["Packing puts short texts together."] * 9),
         "ünïcödé — 你好"]


def copy_folder(target: Path, pooling: dict | None = None, normalize: bool = True) -> Path:
    """The packaged MiniLM folder with its weights linked, not copied; pooling and the
    Normalize module changed as asked."""
    source = minilm_folder()
    target.mkdir()
    for item in source.iterdir():
        if item.is_file():
            (target / item.name).symlink_to(item)
    (target / "1_Pooling").mkdir()
    config = json.loads((source / "1_Pooling" / "config.json").read_text())
    (target / "1_Pooling" / "config.json").write_text(json.dumps({**config, **(pooling or {})}))
    modules = json.loads((source / "modules.json").read_text())
    if not normalize:
        modules = [m for m in modules if not m["type"].endswith("Normalize")]
    (target / "modules.json").unlink()
    (target / "modules.json").write_text(json.dumps(modules))
    return target


def spec(path: Path) -> ModelSpec:
    return ModelSpec(name="f", kind="embedding", queue="f", path=str(path), max_batch_size=8)


def test_the_packaged_folder_says_mean_pooling_normalised_256_tokens():
    config = encoder_config(minilm_folder())
    assert (config.max_seq_length, config.pooling, config.normalize) == (256, ("mean",), True)


def test_cls_and_max_pooling_without_normalisation_match_sentence_transformers(tmp_path):
    from sentence_transformers import SentenceTransformer

    folder = copy_folder(tmp_path / "st", {"pooling_mode_mean_tokens": False,
                                           "pooling_mode_cls_token": True,
                                           "pooling_mode_max_tokens": True}, normalize=False)
    handler = EmbeddingHandler(spec(folder), "cpu")
    handler.initialize()
    assert handler.config.pooling == ("cls", "max") and not handler.config.normalize
    got = handler.predict(TEXTS)  # one packed batch
    want = SentenceTransformer(str(folder), device="cpu").encode(TEXTS).tolist()
    for text, a, b in zip(TEXTS, got, want):
        assert len(a) == len(b) == 768  # two poolings of 384, concatenated
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, text
    assert abs(math.sqrt(sum(x * x for x in got[0])) - 1) > 0.1  # not normalised


def test_a_module_it_cannot_run_is_refused_by_name(tmp_path):
    folder = copy_folder(tmp_path / "dense")
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense",
                    "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="sentence_transformers.models.Dense"):
        encoder_config(folder)


def test_a_folder_with_only_pickled_weights_is_refused(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    shutil.copy(minilm_folder() / "config.json", folder / "config.json")
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04pickled")
    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        model_dir(spec(folder))
