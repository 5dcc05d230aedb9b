"""Image classification over a user's torch.export program (`.pt2`) or TorchScript file.

Inputs arrive in the one format the API makes of every image (app/images.py): base64 of the
model's input picture as RGB bytes, already resized and cropped. Here they become a float
tensor (batch, 3, height, width) scaled to [0, 1] and normalised with the model's declared
mean and std; the model returns one row of class scores per picture, turned into
probabilities (softmax) and each job's `top_k` labels.
"""
from __future__ import annotations

import base64
from typing import Any

from workers.child.handlers.base import Handler
from workers.child.handlers.tensor import load_program, rows_of


class ImageHandler(Handler):
    def initialize(self) -> None:
        import torch

        pre = self.spec.preprocess
        assert pre is not None
        self.height, self.width = pre.size
        self.model = load_program(self.spec, self.device, (3, self.height, self.width))
        self.mean = torch.tensor(pre.mean, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(pre.std, device=self.device).view(1, 3, 1, 1)

    def sample_inputs(self, count: int) -> list:
        grey = base64.b64encode(bytes([128]) * (self.height * self.width * 3)).decode()
        return [grey] * count

    def preprocess(self, items: list) -> Any:
        import numpy as np
        import torch

        size = self.height * self.width * 3
        pictures = [base64.b64decode(item) for item in items]
        wrong = [i for i, p in enumerate(pictures) if len(p) != size]
        if wrong:
            raise ValueError(f"input {wrong[0]} is not a {self.height}x{self.width} RGB "
                             f"picture ({len(pictures[wrong[0]])} bytes, not {size})")
        pixels = np.frombuffer(b"".join(pictures), dtype=np.uint8)
        batch = torch.from_numpy(pixels.reshape(len(items), self.height, self.width, 3).copy())
        batch = batch.to(self.device).permute(0, 3, 1, 2).float().div_(255)
        return (batch - self.mean) / self.std

    def inference(self, batch: Any) -> Any:
        return self.model(batch)

    def postprocess(self, output: Any, count: int) -> list:
        import torch

        scores = rows_of(self.spec.name, output, count).float()
        if self.spec.labels and scores.shape[-1] != len(self.spec.labels):
            raise RuntimeError(f"model {self.spec.name} returned {scores.shape[-1]} scores per "
                               f"picture for {len(self.spec.labels)} labels")
        return torch.softmax(scores, dim=-1).cpu().tolist()

    def finalize(self, outputs: list, options: dict) -> list:
        """`{"label", "scores": {label: probability}}` for the top_k labels, best first;
        without configured labels, a class is named by its index."""
        top_k = int(options.get("top_k") or self.spec.top_k)
        results = []
        for row in outputs:
            names = self.spec.labels or [str(i) for i in range(len(row))]
            best = sorted(range(len(row)), key=row.__getitem__, reverse=True)[:top_k]
            results.append({"label": names[best[0]],
                            "scores": {names[i]: row[i] for i in best}})
        return results
