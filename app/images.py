"""Image inputs, unified before they are queued: whatever way a picture came in (base64, a
`data:` URI, an http(s) URL, uploaded bytes), the worker receives one format only: the model's
input picture as raw RGB bytes (height × width × 3, base64), already resized and cropped as
the model's `preprocess` declares. A bad image is refused here, naming its input, and never
reaches a queue.

Here the encoded image is found (decoded from base64, or fetched: a job's URLs share one
deadline, `image_fetch_deadline_s`) and capped at `max_image_bytes`; the picture is made in a
decoder process (app/decoder_pool.py, app/decoder.py), never in the API's own, so that no image
can hold up the requests beside it; a job's images share one budget of decoding time,
`image_decode_budget_s`, and its key's share of the decoders. Pillow is told the accepted
formats, so no other decoder ever runs. The API never imports torch.
"""
from __future__ import annotations

import base64
import binascii
import re
import time
from dataclasses import dataclass
from typing import Any

from app.decoder_pool import Budget, DecoderPool
from app.decoder import Limits
from app.image_errors import ImageRefused
from app.image_urls import fetch_image
from config import Settings
from config.models import ModelSpec
from config.preprocess import IMAGE_FORMATS

_DATA_URI = re.compile(r"^data:(image/[\w.+-]+)?(;[\w-]+=[^;,]*)*;base64,", re.IGNORECASE)

__all__ = ["BadImages", "ImageRefused", "canonical_inputs", "limits_of"]


class BadImages(Exception):
    """Some inputs were refused: `fields` maps `inputs.<index>` to the reasons."""

    def __init__(self, fields: dict[str, list[str]]) -> None:
        super().__init__(fields)
        self.fields = fields


@dataclass
class _Fetches:
    """The one deadline a job's image URLs share."""
    settings: Settings
    deadline: float | None = None

    def fetch(self, url: str, max_bytes: int) -> bytes:
        budget = self.settings.image_fetch_deadline_s
        if self.deadline is None:
            self.deadline = time.monotonic() + budget
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ImageRefused(f"not fetched: the job's image URLs took their {budget:g}s "
                               "in all")
        return fetch_image(url, self.settings, max_bytes, left)


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused("not valid base64 (nor a data: URI or an http(s) URL)") from None


def image_bytes(value: str | bytes, spec: ModelSpec, fetches: _Fetches) -> bytes:
    """The encoded image an input stands for: uploaded bytes as they are, a data: URI's or
    plain base64's decoded payload, or what an http(s) URL answers."""
    if isinstance(value, bytes):
        data = value
    elif value[:8].lower().startswith(("http://", "https://")):
        data = fetches.fetch(value, spec.max_image_bytes)
    else:
        match = _DATA_URI.match(value)
        if value[:5].lower() == "data:" and not match:
            raise ImageRefused("a data: URI must be data:image/<type>;base64,<data>")
        data = _b64(value[match.end():] if match else value)
    if len(data) > spec.max_image_bytes:
        raise ImageRefused(f"the image is {len(data)} bytes; this model takes at most "
                           f"{spec.max_image_bytes}")
    if not data:
        raise ImageRefused("the image is empty")
    return data


def limits_of(spec: ModelSpec) -> Limits:
    pre = spec.preprocess
    assert pre is not None
    return Limits(IMAGE_FORMATS, spec.max_image_pixels, pre.resize, pre.crop,
                  pre.interpolation)


def canonical_inputs(spec: ModelSpec, inputs: list[Any], settings: Settings,
                     decoders: DecoderPool, owner: str | None = None) -> list[str]:
    """Every input in the canonical format (base64 of the model's input picture as RGB
    bytes), or BadImages naming each one refused. DecodersBusy when no decoder is free.
    `owner`: the API key's name (None when keys are off), whose share of decoders it uses."""
    limits, fetches = limits_of(spec), _Fetches(settings)
    budget = Budget(settings.image_decode_budget_s)
    out: list[str] = []
    refused: dict[str, list[str]] = {}
    for index, value in enumerate(inputs):
        try:
            picture = decoders.picture(image_bytes(value, spec, fetches), limits, owner, budget)
            out.append(base64.b64encode(picture).decode("ascii"))
        except ImageRefused as exc:
            refused[f"inputs.{index}"] = [str(exc)]
    if refused:
        raise BadImages(refused)
    return out
