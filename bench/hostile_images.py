"""Images under every byte and pixel cap of an image model's defaults that are slow or
memory-hungry to decode, as the security review sent them (issue 26), and what the API does
with them sent in a loop: `/healthz` probed meanwhile, every answer counted.

    python -m bench.hostile_images --seconds 60 --clients 4 [--out FILE]

starts a stack (Redis, one worker, the gevent API, all on their defaults) with an image model
on the default limits, sends the four hostile requests (a progressive JPEG of many scans, 64
one-bit 39 MP PNGs in one multipart request, an animated WebP on a 39 MP canvas, a 16-bit
RGBA 39 MP PNG) from `--clients` threads for `--seconds`, probes `/healthz` every 20 ms, and
prints the probes' p50/p99/max, the answers by request and status, and whether the API's
processes are the ones it started with. tests/integration/test_hostile_images.py runs
`hammer` briefly on the test stack.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import struct
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

import psutil
import requests
from PIL import Image

SIDE = 6245  # 6245 x 6245 = 39 MP, under the default max_image_pixels (40 MP)


def _segments(jpeg: bytes) -> list[bytes]:
    """A JPEG cut into its marker segments, each scan with its entropy-coded data."""
    out, pos = [jpeg[:2]], 2
    while pos < len(jpeg):
        marker = jpeg[pos + 1]
        if marker == 0xD9:  # EOI
            out.append(jpeg[pos:pos + 2])
            break
        length = struct.unpack(">H", jpeg[pos + 2:pos + 4])[0]
        end = pos + 2 + length
        if marker == 0xDA:  # SOS: the data runs to the next marker that is not a stuffed FF00/RST
            while not (jpeg[end] == 0xFF and jpeg[end + 1] not in (0x00, *range(0xD0, 0xD8))):
                end += 1
        out.append(jpeg[pos:end])
        pos = end
    return out


def progressive_jpeg(scans: int, side: int = 6000) -> bytes:
    """A flat grey progressive JPEG of side x side whose last scan (an AC refinement of an
    all-zero band: a few bytes of end-of-band runs) is repeated until it has `scans` scans.
    Each repeat makes libjpeg walk every block of the picture again."""
    out = io.BytesIO()
    Image.new("L", (side, side), 128).save(out, "JPEG", progressive=True, quality=90)
    parts = _segments(out.getvalue())
    sos = [i for i, part in enumerate(parts) if part[1] == 0xDA]
    extra = scans - len(sos)
    return b"".join(parts[:-1]) + parts[sos[-1]] * max(extra, 0) + parts[-1]


def one_bit_png(side: int = SIDE) -> bytes:
    """A blank 1-bit PNG: a few kilobytes that declare side x side pixels."""
    out = io.BytesIO()
    Image.new("1", (side, side), 0).save(out, "PNG", optimize=True)
    return out.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + \
        struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def rgba16_png(side: int = SIDE) -> bytes:
    """A blank 16-bit RGBA PNG: 8 bytes of raw data a pixel, deflated to a few hundred KB."""
    row = b"\x00" + bytes(side * 8)  # filter byte "none", then the row's samples
    deflate = zlib.compressobj(9)
    data = b"".join(deflate.compress(row) for _ in range(side)) + deflate.flush()
    header = struct.pack(">IIBBBBB", side, side, 16, 6, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", data) + \
        _chunk(b"IEND", b"")


def _riff_chunk(kind: bytes, data: bytes) -> bytes:
    return kind + struct.pack("<I", len(data)) + data + (b"\x00" if len(data) % 2 else b"")


def animated_webp(side: int = SIDE) -> bytes:
    """An animated WebP of about a hundred bytes: a side x side canvas (VP8X) holding two
    1 x 1 lossless frames."""
    out = io.BytesIO()
    Image.new("RGBA", (1, 1), (255, 0, 0, 255)).save(out, "WEBP", lossless=True)
    still = out.getvalue()
    vp8l = still[12:]  # the RIFF body's one chunk: VP8L
    assert vp8l[:4] == b"VP8L", vp8l[:4]

    def u24(n: int) -> bytes:
        return struct.pack("<I", n)[:3]

    frame = u24(0) + u24(0) + u24(0) + u24(0) + u24(100) + b"\x00"  # x, y, w-1, h-1, ms, flags
    flags = 0x02 | 0x10  # animation, alpha
    vp8x = bytes([flags, 0, 0, 0]) + u24(side - 1) + u24(side - 1)
    body = b"WEBP" + _riff_chunk(b"VP8X", vp8x) + \
        _riff_chunk(b"ANIM", b"\x00\x00\x00\x00" + struct.pack("<H", 0)) + \
        _riff_chunk(b"ANMF", frame + vp8l) * 2
    return b"RIFF" + struct.pack("<I", len(body)) + body


def junk_after_app0(jpeg: bytes) -> bytes:
    """The JPEG with one stray byte after its first segment (APP0), which libjpeg skips
    (the attack on issue 26's first scan counter, which stopped walking there)."""
    assert jpeg[2:4] == b"\xff\xe0", jpeg[2:4]
    end = 4 + int.from_bytes(jpeg[4:6], "big")
    return jpeg[:end] + b"\x00" + jpeg[end:]


def as_mpo(jpeg: bytes) -> bytes:
    """The JPEG twice over, with an APP2 MPF segment that declares both: Pillow opens it as
    MPO, not JPEG."""
    def mpf(second: int, size: int) -> bytes:
        entries = struct.pack(">IIIHH", 0x20030000, size, 0, 0, 0) + \
            struct.pack(">IIIHH", 0, size, second, 0, 0)
        ifd = struct.pack(">H", 3) + struct.pack(">HHI4s", 0xB000, 7, 4, b"0100") + \
            struct.pack(">HHII", 0xB001, 4, 1, 2) + \
            struct.pack(">HHII", 0xB002, 7, len(entries), 8 + 2 + 3 * 12 + 4) + bytes(4)
        body = b"MPF\x00" + b"MM\x00\x2a" + struct.pack(">I", 8) + ifd + entries
        return b"\xff\xe2" + struct.pack(">H", len(body) + 2) + body

    segment = len(mpf(0, 0))
    size = len(jpeg) + segment
    # MPF offsets count from its TIFF header: SOI, marker, length and "MPF\0" into the file.
    return jpeg[:2] + mpf(size - (2 + 4 + 4), size) + jpeg[2:] + jpeg


def chunk_before_ihdr(png: bytes) -> bytes:
    """The PNG with a private chunk ahead of IHDR whose bytes sit where IHDR's bit depth and
    colour type would be (1-bit grey), were they read at a fixed offset."""
    return png[:8] + _chunk(b"prVt", bytes(8) + bytes([1, 0]) + bytes(3)) + png[8:]


def requests_to_send(model: str, jpeg_scans: int = 600) -> dict[str, dict]:
    """The review's four requests, as keyword arguments of requests.post: name -> kwargs."""
    def as_json(*images: bytes) -> dict:
        return {"json": {"model": model,
                         "inputs": [base64.b64encode(i).decode() for i in images]}}

    bit = one_bit_png()
    return {
        "progressive-jpeg": as_json(progressive_jpeg(jpeg_scans)),
        "64 one-bit pngs": {"data": {"job": json.dumps({"model": model})},
                            "files": [("inputs", (f"{i}.png", bit, "image/png"))
                                      for i in range(64)]},
        "animated-webp": as_json(animated_webp()),
        "16-bit rgba png": as_json(rgba16_png()),
    }


def api_processes(master_pid: int) -> set[int]:
    """The gunicorn master and its workers (the decoders, grandchildren, are not counted)."""
    master = psutil.Process(master_pid)
    return {master_pid, *(child.pid for child in master.children())}


def hammer(api: str, to_send: dict[str, dict], seconds: float, clients: int) -> dict:
    """Send `to_send` in turn from `clients` threads for `seconds` while probing /healthz
    every 20 ms. Returns the probes' latencies (s), the answers by request and status, and
    the refusals' messages by request."""
    stop = time.monotonic() + seconds
    probes: list[float] = []
    answers: Counter = Counter()
    refusals: dict[str, set] = {name: set() for name in to_send}
    lock = threading.Lock()

    def probe() -> None:
        while time.monotonic() < stop:
            started = time.monotonic()
            ok = requests.get(f"{api}/healthz", timeout=120).status_code == 200
            with lock:
                probes.append(time.monotonic() - started if ok else float("inf"))
            time.sleep(0.02)

    def client(offset: int) -> None:
        names = list(to_send)
        i = offset
        while time.monotonic() < stop:
            name = names[i % len(names)]
            i += 1
            r = requests.post(f"{api}/v1/jobs", timeout=120, **to_send[name])
            with lock:
                answers[(name, r.status_code)] += 1
                if r.status_code == 422:
                    refusals[name].update(m for messages in r.json()["error"]["fields"].values()
                                          for m in messages)

    threads = [threading.Thread(target=probe)] + [
        threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"probes": probes, "answers": answers, "refusals": refusals}


def main(argv: list[str] | None = None) -> int:
    import torch

    from bench.load import percentile
    from scripts.stack import launch

    class Mean(torch.nn.Module):  # a stand-in image model: each channel's mean
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mean(dim=(2, 3))

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        torch.jit.script(Mean()).save(str(workdir / "mean.pt"))
        model = {"kind": "image", "path": str(workdir / "mean.pt"),  # the default limits
                 "labels": ["red", "green", "blue"], "preprocess": {"resize": 40, "crop": 32}}
        stack = launch(workdir, {"vision": model}, {"w": ["vision"]}, defaults=True)
        try:
            before = api_processes(stack.web.proc.pid)
            seen = hammer(stack.api, requests_to_send("vision"), args.seconds, args.clients)
            after = api_processes(stack.web.proc.pid)
        finally:
            stack.stop()
    probes = sorted(seen["probes"])
    report = {
        "seconds": args.seconds, "clients": args.clients, "probes": len(probes),
        "healthz_ms": {"p50": round(percentile(probes, 50) * 1000, 1),
                       "p99": round(percentile(probes, 99) * 1000, 1),
                       "max": round(probes[-1] * 1000, 1)},
        "answers": {f"{name} -> {status}": n
                    for (name, status), n in sorted(seen["answers"].items())},
        "api_processes_unchanged": before == after,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
