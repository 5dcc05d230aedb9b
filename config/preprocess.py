"""How an image model's input is made (`preprocess:` in models.yaml): resize, centre crop and
normalise, as torchvision's Resize → CenterCrop → ToTensor → Normalize would on a PIL image.

The API applies the geometry (it decodes the image anyway, and a 12-megapixel photo shrinks
to the model's input size before it is queued); the worker normalises. No torch or Pillow here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from config.settings import ConfigError

IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
IMAGE_SOURCES = ("base64", "data_uri", "url", "upload")
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "lanczos")


@dataclass(frozen=True)
class ImagePreprocess:
    # (side,): the shorter side becomes `side`, aspect kept; (height, width): exactly that.
    resize: tuple[int, ...]
    crop: tuple[int, int] | None = None  # centre crop (height, width) after the resize
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)  # per RGB channel, on values in [0, 1]
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    interpolation: str = "bilinear"

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of the picture the model receives."""
        if self.crop:
            return self.crop
        assert len(self.resize) == 2
        return (self.resize[0], self.resize[1])

    def public(self) -> dict[str, Any]:
        return {"resize": list(self.resize), "crop": list(self.crop) if self.crop else None,
                "mean": list(self.mean), "std": list(self.std),
                "interpolation": self.interpolation, "size": list(self.size)}


def _sides(where: str, key: str, value: Any, allow_one: bool) -> tuple[int, ...]:
    items = [value] if isinstance(value, int) and allow_one else value
    if isinstance(value, int) and not allow_one:
        items = [value, value]
    ok = isinstance(items, list) and len(items) in ((1, 2) if allow_one else (2,)) and all(
        isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= 8192 for x in items)
    if not ok:
        raise ConfigError(f"{where}: {key} must be an integer or [height, width] in 1..8192, "
                          f"got {value!r}")
    return tuple(items)


def _triple(where: str, key: str, value: Any, positive: bool) -> tuple[float, float, float]:
    ok = isinstance(value, list) and len(value) == 3 and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and (x > 0 or not positive)
        for x in value)
    if not ok:
        rule = "three numbers > 0" if positive else "three numbers"
        raise ConfigError(f"{where}: {key} must be {rule} (R, G, B), got {value!r}")
    return (float(value[0]), float(value[1]), float(value[2]))


def parse_preprocess(where: str, raw: Any) -> ImagePreprocess:
    if not isinstance(raw, dict) or "resize" not in raw:
        raise ConfigError(f"{where}: an image model needs `preprocess` with at least `resize`")
    unknown = set(raw) - {"resize", "crop", "mean", "std", "interpolation"}
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    resize = _sides(where, "resize", raw["resize"], allow_one=True)
    crop = _sides(where, "crop", raw["crop"], allow_one=False) if "crop" in raw else None
    if len(resize) == 1 and crop is None:
        raise ConfigError(f"{where}: resize to a shorter side of {resize[0]} keeps the aspect "
                          f"ratio; add `crop` so that every input has one size")
    if crop:
        smallest = (resize[0], resize[0]) if len(resize) == 1 else resize
        if crop[0] > smallest[0] or crop[1] > smallest[1]:
            raise ConfigError(f"{where}: crop {list(crop)} is larger than the resized "
                              f"picture {list(smallest)}")
    interpolation = raw.get("interpolation", "bilinear")
    if interpolation not in INTERPOLATIONS:
        raise ConfigError(f"{where}: interpolation must be one of {', '.join(INTERPOLATIONS)}; "
                          f"got {interpolation!r}")
    return ImagePreprocess(
        resize=resize, crop=crop, interpolation=interpolation,
        mean=_triple(where, "mean", raw.get("mean", [0, 0, 0]), positive=False),
        std=_triple(where, "std", raw.get("std", [1, 1, 1]), positive=True))
