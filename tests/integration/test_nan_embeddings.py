"""An embedding model whose vectors hold NaN (a broken checkpoint, an fp16 overflow) through the
real text model path: asked for base64, each output is still the base64 of its float32 values
(NaN where the model gave NaN), as for any other vector; asked for numbers, NaN is null."""
from __future__ import annotations

import base64
import shutil

import numpy as np

from scripts.stack import launch
from tests.support.models import minilm_folder


def test_a_nan_embedding_is_base64_when_asked(tmp_path):
    import torch
    from transformers import AutoModel

    folder = tmp_path / "nan-minilm"
    shutil.copytree(minilm_folder(), folder)
    model = AutoModel.from_pretrained(folder)
    with torch.no_grad():  # every vector NaN: the last layer's norm scales by NaN
        model.encoder.layer[-1].output.LayerNorm.weight[:5] = float("nan")
    model.save_pretrained(folder)
    declared = {"kind": "embedding", "path": str(folder), "max_batch_size": 4, "max_inputs": 4}
    stack = launch(tmp_path, {"nan-embed": declared}, {"w": ["nan-embed"]})
    try:
        texts = ["a", "b c"]
        numbers = stack.finished(stack.submit("nan-embed", texts)["id"], timeout=120)
        packed = stack.finished(stack.submit("nan-embed", texts, encoding_format="base64")["id"],
                                timeout=120)
        assert numbers["status"] == packed["status"] == "succeeded"
        assert [set(v) for v in numbers["result"]["outputs"]] == [{None}, {None}]
        for text in packed["result"]["outputs"]:
            assert isinstance(text, str), text
            assert np.isnan(np.frombuffer(base64.b64decode(text), "<f4")).sum() == 384
    finally:
        stack.stop()
