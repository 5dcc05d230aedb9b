"""Image inputs, unified before they are queued: whatever way a picture came in (base64, a
`data:` URI, an http(s) URL, uploaded bytes), the worker receives one format only: the model's
input picture as raw RGB bytes (height × width × 3, base64), already resized and cropped as
the model's `preprocess` declares. A bad image is refused here, naming its input, and never
reaches a queue.

Each image is checked before it is decoded: at most `max_image_bytes` bytes, one of the
accepted formats (Pillow is told which, so no other decoder ever runs), and at most
`max_image_pixels` pixels as its header declares them (a decompression bomb is refused before
its pixels are). Pillow only; the API never imports torch.
"""
from __future__ import annotations

import base64
import binascii
import io
import re
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

from app.image_errors import ImageRefused
from app.image_urls import fetch_image
from config import Settings
from config.models import ModelSpec
from config.preprocess import IMAGE_FORMATS, ImagePreprocess

_DATA_URI = re.compile(r"^data:(image/[\w.+-]+)?(;[\w-]+=[^;,]*)*;base64,", re.IGNORECASE)
_RESAMPLE = {"nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR,
             "bicubic": Image.Resampling.BICUBIC, "lanczos": Image.Resampling.LANCZOS}


class BadImages(Exception):
    """Some inputs were refused: `fields` maps `inputs.<index>` to the reasons."""

    def __init__(self, fields: dict[str, list[str]]) -> None:
        super().__init__(fields)
        self.fields = fields


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused("not valid base64 (nor a data: URI or an http(s) URL)") from None


def image_bytes(value: str | bytes, spec: ModelSpec, settings: Settings) -> bytes:
    """The encoded image an input stands for: uploaded bytes as they are, a data: URI's or
    plain base64's decoded payload, or what an http(s) URL answers."""
    if isinstance(value, bytes):
        data = value
    elif value[:8].lower().startswith(("http://", "https://")):
        data = fetch_image(value, settings, spec.max_image_bytes)
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


def decode(data: bytes, spec: ModelSpec) -> Image.Image:
    """The picture, fully decoded, upright (EXIF orientation) and in RGB."""
    accepted = ", ".join(IMAGE_FORMATS)
    try:
        # Reads the header only. Pillow's own bomb check (an error past twice
        # Image.MAX_IMAGE_PIXELS) may fire here; the model's cap is checked just below.
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except UnidentifiedImageError:
        raise ImageRefused(f"not an image in a supported format ({accepted})") from None
    except Image.DecompressionBombError:
        raise ImageRefused(f"the image has more than {spec.max_image_pixels} pixels") from None
    width, height = image.size
    if width * height > spec.max_image_pixels:
        raise ImageRefused(f"the image is {width}x{height} = {width * height} pixels; this "
                           f"model takes at most {spec.max_image_pixels}")
    try:
        image.load()
        image = ImageOps.exif_transpose(image)
        return image.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - whatever a decoder raises, the image is bad
        raise ImageRefused(f"the {image.format} image cannot be decoded (truncated or "
                           f"corrupt): {type(exc).__name__}: {exc}") from None


def fit(image: Image.Image, pre: ImagePreprocess) -> Image.Image:
    """Resize, then centre-crop, as torchvision's Resize and CenterCrop do on a PIL image."""
    width, height = image.size
    if len(pre.resize) == 1:
        side = pre.resize[0]
        if width <= height:
            size = (side, int(side * height / width))
        else:
            size = (int(side * width / height), side)
    else:
        size = (pre.resize[1], pre.resize[0])
    image = image.resize(size, _RESAMPLE[pre.interpolation])
    if pre.crop:
        crop_h, crop_w = pre.crop
        top = int(round((image.height - crop_h) / 2.0))
        left = int(round((image.width - crop_w) / 2.0))
        image = image.crop((left, top, left + crop_w, top + crop_h))
    return image


def canonical(value: str | bytes, spec: ModelSpec, settings: Settings) -> str:
    """The one format workers receive: base64 of the model's input picture as RGB bytes."""
    assert spec.preprocess is not None
    picture = fit(decode(image_bytes(value, spec, settings), spec), spec.preprocess)
    return base64.b64encode(picture.tobytes()).decode("ascii")


def canonical_inputs(spec: ModelSpec, inputs: list[Any], settings: Settings) -> list[str]:
    """Every input in the canonical format, or BadImages naming each one refused."""
    out: list[str] = []
    refused: dict[str, list[str]] = {}
    for index, value in enumerate(inputs):
        try:
            out.append(canonical(value, spec, settings))
        except ImageRefused as exc:
            refused[f"inputs.{index}"] = [str(exc)]
    if refused:
        raise BadImages(refused)
    return out
