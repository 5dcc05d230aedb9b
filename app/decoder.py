"""Image decoding, in a process of its own (app/decoder_pool.py runs a few): what makes a decoder
slow or memory-hungry is refused from the header first, then the picture is decoded, turned
upright, converted to RGB, resized and centre-cropped, and its raw bytes go back.

Run as `python -I app/decoder.py MEMORY_MB`, it serves requests on stdin (frames below) until
stdin closes, with its address space capped at MEMORY_MB: a picture that needs more is refused,
never a danger to the API. It imports Pillow and the standard library only, so that it starts
in a fraction of a second and holds nothing of the API (no settings, no secrets). Before it
reads an image it gives up what a decoder does not need (`confine`): the network (a network
namespace of its own, where the kernel allows one), the folders named on its command line (the
API's var dir with its secrets) and /proc (a mount namespace of its own with an empty tmpfs
over each, where the kernel allows one), root (started as root, it becomes a user of its own,
DECODER_UID_BASE + its pid, with no passwd entry, which no other process is, so it can signal
or read none), and any way back to more privileges (no_new_privs); and it works from `/`.

The refusals before decoding, each cheap (what Pillow parsed of the header, or one pass over
the bytes), none of which padding the file or reordering its chunks can get past:

* more pixels than the model's `max_image_pixels` (decompression bombs);
* more sample data than an 8-bit RGBA picture of `max_image_pixels` (a 16-bit PNG may have
  half the pixels), from the bit depth and colour type Pillow read from the PNG's IHDR;
* an animation (GIF, WebP, PNG, MPO) with more than a quarter of `max_image_pixels` on its
  canvas: its decoder holds the canvas, in RGBA, several times over;
* a JPEG (or MPO, JPEGs one after another) with more than MAX_JPEG_SCANS scans: each scan of a
  progressive JPEG is a pass over the whole picture, and a few bytes make one. Scans are
  counted by walking the markers as libjpeg does, skipping stray bytes between segments.

What the header cannot tell (a picture under every cap that is merely slow) is bounded by the
decoder's deadline and memory, and by the budget a request's images share (app/decoder_pool.py).

Frames: first, once confined, the decoder says what it gave up: an answer frame (below) whose
body is JSON (`uid`, `network`: "none" or "shared", `hidden`, `no_new_privs`). Then request
`>II` (header length, data length), a JSON header (`Limits`), the image; answer `>BI` (OK or
REFUSED, length), then the picture's RGB bytes or the refusal's code (`Refused.code`, ASCII):
the API words the client's message itself, so that a decoder cannot pass it any text.
"""
from __future__ import annotations

import ctypes
import io
import json
import os
import re
import resource
import struct
import sys
from dataclasses import asdict, dataclass
from typing import BinaryIO

from PIL import Image, ImageOps, UnidentifiedImageError

MAX_JPEG_SCANS = 64
OK, REFUSED = 1, 0
REQUEST, ANSWER = struct.Struct(">II"), struct.Struct(">BI")

_RESAMPLE = {"nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR,
             "bicubic": Image.Resampling.BICUBIC, "lanczos": Image.Resampling.LANCZOS}
# A JPEG marker inside entropy-coded data: FF followed by neither a stuffed 00 nor a restart.
_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7]")
# Markers without a length: TEM, RSTn, SOI, EOI (and 00, a stuffed byte out of place).
_NO_LENGTH = frozenset({0x00, 0x01, *range(0xD0, 0xDA)})
# Bits a pixel of the PNG raw modes Pillow reads (from IHDR's bit depth and colour type).
_PNG_BITS = {"1": 1, "L;2": 2, "L;4": 4, "L": 8, "I;16B": 16, "P;1": 1, "P;2": 2, "P;4": 4,
             "P": 8, "RGB": 24, "RGB;16B": 48, "LA": 16, "LA;16B": 32, "RGBA": 32,
             "RGBA;16B": 64}


class Refused(ValueError):
    """This image is refused; the message says why, `code` (one of CODES) what the decoder
    answers the API, which words its own ImageRefused from it (this module imports nothing of
    the project's, as it runs on its own)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


CODES = ("format", "pixels", "samples", "animation", "scans", "memory", "corrupt")


@dataclass(frozen=True)
class Limits:
    """What one model accepts and makes of a picture (from its ModelSpec and preprocess)."""
    formats: tuple[str, ...]
    max_pixels: int
    resize: tuple[int, ...]  # (side,): the shorter side; (height, width): exactly
    crop: tuple[int, int] | None
    interpolation: str

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Limits":
        data = json.loads(raw)
        return cls(tuple(data["formats"]), data["max_pixels"], tuple(data["resize"]),
                   tuple(data["crop"]) if data["crop"] else None, data["interpolation"])


def jpeg_scans(data: bytes, stop_after: int) -> int:
    """The scans (SOS markers) of a JPEG, or of JPEGs one after another (MPO), counted by
    walking its markers as libjpeg reads them: whatever is not a marker where one is expected
    is skipped up to the next FF, fill bytes (FF FF) are skipped, a segment is skipped by its
    length, a scan's data runs to the next marker. Stops counting past `stop_after`."""
    pos, scans = 0, 0
    while scans <= stop_after:
        pos = data.find(b"\xff", pos)
        if pos < 0 or pos + 1 >= len(data):
            break
        marker = data[pos + 1]
        if marker == 0xFF:  # a fill byte
            pos += 1
        elif marker in _NO_LENGTH:
            pos += 2
        else:
            pos += 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
            if marker == 0xDA:
                scans += 1
                found = _MARKER.search(data, pos)
                if found is None:
                    break
                pos = found.start()
    return scans


def _sample_bytes(image: Image.Image) -> float:
    """Bytes of samples the decoder inflates: for a PNG from its raw mode, as Pillow read it
    from IHDR (bit depth and colour type), else one byte per band."""
    if image.format == "PNG" and image.tile:
        rawmode = image.tile[0].args  # Pillow's PNG tile carries its raw mode as its args
        bits = _PNG_BITS.get(rawmode if isinstance(rawmode, str) else "", 64)
        return image.width * image.height * bits / 8
    return image.width * image.height * len(image.getbands())


def check(image: Image.Image, data: bytes, limits: Limits) -> None:
    """The refusals of the module docstring, from what the header declares."""
    width, height = image.size
    pixels = width * height
    if pixels > limits.max_pixels:
        raise Refused("pixels", f"the image is {width}x{height} = {pixels} pixels; this "
                      f"model takes at most {limits.max_pixels}")
    samples, most = _sample_bytes(image), 4 * limits.max_pixels
    if samples > most:
        raise Refused("samples", f"the image holds {samples / 2**20:.0f} MiB of samples; "
                      f"this model takes at most {most / 2**20:.0f} MiB (as in 8-bit RGBA at "
                      f"{limits.max_pixels} pixels)")
    if getattr(image, "is_animated", False) and pixels > limits.max_pixels // 4:
        raise Refused("animation", f"the image is an animation on a {width}x{height} canvas; "
                      f"animations may have at most {limits.max_pixels // 4} pixels")
    if image.format in ("JPEG", "MPO"):
        if jpeg_scans(data, MAX_JPEG_SCANS) > MAX_JPEG_SCANS:
            raise Refused("scans", f"the JPEG has more than {MAX_JPEG_SCANS} scans")


def fit(image: Image.Image, limits: Limits) -> Image.Image:
    """Resize, then centre-crop, as torchvision's Resize and CenterCrop do on a PIL image."""
    width, height = image.size
    if len(limits.resize) == 1:
        side = limits.resize[0]
        if width <= height:
            size = (side, int(side * height / width))
        else:
            size = (int(side * width / height), side)
    else:
        size = (limits.resize[1], limits.resize[0])
    image = image.resize(size, _RESAMPLE[limits.interpolation])
    if limits.crop:
        crop_h, crop_w = limits.crop
        top = int(round((image.height - crop_h) / 2.0))
        left = int(round((image.width - crop_w) / 2.0))
        image = image.crop((left, top, left + crop_w, top + crop_h))
    return image


def picture(data: bytes, limits: Limits) -> bytes:
    """The model's input picture as raw RGB bytes, or Refused saying why not."""
    accepted = ", ".join(limits.formats)
    try:
        # Reads the header only. Pillow's own bomb check (an error past twice
        # Image.MAX_IMAGE_PIXELS) may fire here; the model's cap is checked in `check`.
        image = Image.open(io.BytesIO(data), formats=limits.formats)
    except UnidentifiedImageError:
        raise Refused("format", f"not an image in a supported format ({accepted})") from None
    except Image.DecompressionBombError:
        raise Refused("pixels", f"the image has more than {limits.max_pixels} pixels") from None
    except Exception as exc:  # noqa: BLE001 - a header Pillow cannot parse: truncated, corrupt
        raise _corrupt(None, exc) from None
    try:
        check(image, data, limits)
        image.load()
        image = ImageOps.exif_transpose(image).convert("RGB")
        return fit(image, limits).tobytes()
    except Refused:  # what the header declares (`check`)
        raise
    except MemoryError:
        raise Refused("memory", "the image needs more memory to decode than a decoder may use")
    except Exception as exc:  # noqa: BLE001 - whatever a decoder raises, the image is bad
        raise _corrupt(image.format, exc) from None


def _corrupt(fmt: str | None, exc: Exception) -> Refused:
    """The refusal of an image Pillow raised on. A header it could not parse (a JPEG cut in its
    markers raises OSError from Image.open) is refused as a body cut in its data is: the
    decoder lives on. Before, that OSError ended the decoder, and a flood of such files from
    one client kept every decoder restarting, so that others' good images got 503."""
    named = f"{fmt} image" if fmt else "image"
    return Refused("corrupt", f"the {named} cannot be decoded (truncated or corrupt): "
                   f"{type(exc).__name__}: {exc}")


def _read(stream: BinaryIO, size: int) -> bytes | None:
    data = stream.read(size)
    return data if len(data) == size else None


def serve(requests: BinaryIO, answers: BinaryIO) -> None:
    """Answer framed requests until `requests` ends."""
    while (head := _read(requests, REQUEST.size)) is not None:
        header_size, data_size = REQUEST.unpack(head)
        header, data = _read(requests, header_size), _read(requests, data_size)
        if header is None or data is None:
            return
        try:
            kind, body = OK, picture(data, Limits.from_json(header))
        except Refused as refused:
            kind, body = REFUSED, refused.code.encode()
        answers.write(ANSWER.pack(kind, len(body)) + body)
        answers.flush()


_CLONE_NEWNS, _CLONE_NEWNET, _CLONE_NEWUSER = 0x00020000, 0x40000000, 0x10000000
_PR_SET_NO_NEW_PRIVS = 38
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 1, 2, 4, 8, 0x4000, 1 << 18
# A decoder of an API run as root becomes uid (and gid) DECODER_UID_BASE + its pid: a user of
# its own (no other live process has that pid), far above the ids systems hand out (and below
# 2**32 - 2 for any pid Linux allows, at most 2**22).
DECODER_UID_BASE = 0xE0000000


def _unshared(libc: ctypes.CDLL, flags: int) -> bool:
    return libc.unshare(flags) == 0


def _hide(libc: ctypes.CDLL, folders: list[str]) -> bool:
    """An empty, read-only tmpfs over each folder, in this process's own mount namespace
    (entered already), its mounts made private first so that nothing leaves it."""
    if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return False
    flags = _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    return all(libc.mount(b"none", os.fsencode(folder), b"tmpfs", flags, b"size=4k,mode=0") == 0
               for folder in folders if os.path.isdir(folder))


def _become_own_user() -> int:
    uid = DECODER_UID_BASE + os.getpid()
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    return uid


def confine(hidden: list[str]) -> dict:
    """Give up what decoding does not need, before any image is read; say what was given up.
    No network: a network namespace of its own with no interface up; `hidden` folders and
    /proc out of sight: a mount namespace of its own (as root directly; as any other user
    inside a user namespace of its own, where the kernel allows one; else the network stays,
    'shared', and nothing is hidden). Pillow's format plugins are imported first, while their
    files can still be read."""
    Image.init()
    libc = ctypes.CDLL(None, use_errno=True)
    uid = os.getuid()
    namespaces = _CLONE_NEWNET | _CLONE_NEWNS | (0 if uid == 0 else _CLONE_NEWUSER)
    isolated = _unshared(libc, namespaces)
    out_of_sight = isolated and _hide(libc, ["/proc", *hidden])
    if uid == 0:
        uid = _become_own_user()
    # (In a user namespace of its own getuid() says 65534: `uid` is the one outside.)
    os.chdir("/")
    no_new_privs = libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
    return {"uid": uid, "network": "none" if isolated else "shared", "hidden": out_of_sight,
            "no_new_privs": no_new_privs}


def main(argv: list[str]) -> None:
    memory = int(argv[1]) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    hello = json.dumps(confine(argv[2:])).encode()
    sys.stdout.buffer.write(ANSWER.pack(OK, len(hello)) + hello)
    sys.stdout.buffer.flush()
    serve(sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    main(sys.argv)
