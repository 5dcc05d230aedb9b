"""INT8 weights (dtype: int8, dynamic quantisation of the linear layers) against float32, on
the packaged MiniLM. Bound: every text's vector has a cosine >= 0.90 to its float32 vector,
the mean over texts >= 0.95 (measured: 0.92 for the empty text, 0.97 to 0.98 for the others).
Zero-shot labels with a clear float32 margin do not change; a slim one can: "The striker
scored twice…" is sports by 0.131 to 0.098 for cooking in float32, cooking by 0.122 to 0.093
in int8. Speed and memory: bench/quantised.py."""
from __future__ import annotations

import numpy as np
import torch

from config.models import ModelSpec
from tests.support.models import minilm_folder
from workers.child.handlers.text import ClassificationHandler, EmbeddingHandler

TEXTS = ["The striker scored twice in the final match of the season.",
         "Parliament passed the new budget after a long debate.",
         "Whisk the eggs with sugar, then fold in the flour.",
         "", "ünïcödé — 你好 🌍", " ".join(["A long text about many things."] * 30)]
CLEAR = ["The telescope revealed a distant spiral galaxy",
         "Plant the tomato seedlings in rich, well-watered soil"]
LABELS = ["astronomy", "gardening"]


def spec(kind: str, dtype: str) -> ModelSpec:
    return ModelSpec(name=f"m-{dtype}", kind=kind, queue="m", path=str(minilm_folder()),
                     dtype=dtype, max_batch_size=8)


def test_int8_vectors_stay_close_to_float32_and_clear_labels_do_not_change():
    fp32 = EmbeddingHandler(spec("embedding", "float32"), "cpu")
    int8 = ClassificationHandler(spec("classification", "int8"), "cpu")
    for handler in (fp32, int8):
        handler.initialize()
    linear = [m for m in int8.model.modules() if isinstance(m, torch.nn.Linear)]
    quantised = [m for m in int8.model.modules()
                 if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    assert quantised and not linear, "every linear layer is quantised"

    # fp32's rows are float32 numpy rows (output_rows), int8's (a classifier's) lists.
    want, got = (torch.tensor(np.asarray(h.predict(TEXTS), dtype=np.float32))
                 for h in (fp32, int8))
    cosines = torch.nn.functional.cosine_similarity(want, got)
    assert cosines.min() >= 0.90 and cosines.mean() >= 0.95, cosines.tolist()
    assert not torch.allclose(want, got, atol=1e-4)  # it really ran on other weights

    (labelled,) = int8.run([(CLEAR, {"labels": LABELS})])
    assert [out["label"] for out in labelled] == LABELS
