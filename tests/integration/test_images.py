"""Image inputs through the real API and workers: every way of sending a picture gives what
the model itself gives on the same preprocessed tensor, a drawn picture is recognised, and
bad images are refused naming their input."""
from __future__ import annotations

import base64
import io
import json
import struct
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import requests
from PIL import Image, ImageDraw

from tests.support.models import VISION_LABELS, VISION_PREPROCESS

MODEL = "tiny-vision"


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


def stop_sign() -> Image.Image:
    """A red octagonal STOP sign on a white ground."""
    image = Image.new("RGB", (120, 100), "white")
    draw = ImageDraw.Draw(image)
    draw.regular_polygon((60, 50, 44), 8, rotation=22.5, fill=(200, 16, 32))
    draw.text((44, 44), "STOP", fill="white")
    return image


def tree() -> Image.Image:
    """A green tree with a brown trunk under a white sky."""
    image = Image.new("RGB", (90, 130), "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle((38, 85, 52, 125), fill=(110, 70, 30))
    draw.ellipse((8, 8, 82, 95), fill=(30, 160, 50))
    return image


def noise(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def direct(stack):
    """The model itself on the picture preprocessed as torchvision's Resize(40),
    CenterCrop(32), ToTensor() and Normalize(mean, std) define it (written out here with
    Pillow and numpy: torchvision 0.28 does not import beside this CPU torch)."""
    import torch

    model = torch.export.load(stack.declared(MODEL)["path"]).module()
    mean = torch.tensor(VISION_PREPROCESS["mean"]).view(3, 1, 1)
    std = torch.tensor(VISION_PREPROCESS["std"]).view(3, 1, 1)

    def scores(data: bytes) -> dict[str, float]:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        w, h = image.size
        size = (40, int(40 * h / w)) if w <= h else (int(40 * w / h), 40)
        image = image.resize(size, Image.Resampling.BILINEAR)
        top, left = int(round((image.height - 32) / 2)), int(round((image.width - 32) / 2))
        image = image.crop((left, top, left + 32, top + 32))
        x = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255
        probs = torch.softmax(model(((x - mean) / std).unsqueeze(0)), dim=-1)[0].tolist()
        return dict(zip(VISION_LABELS, probs))

    return scores


def check(output: dict, want: dict[str, float]) -> None:
    assert list(output["scores"]) == sorted(want, key=want.get, reverse=True)  # best first
    assert output["scores"] == pytest.approx(want, abs=1e-5)
    assert output["label"] == max(want, key=want.get)


def finished(stack, response: requests.Response) -> list:
    assert response.status_code == 202, response.text
    body = stack.finished(response.json()["id"])
    assert body["status"] == "succeeded", body
    return body["result"]["outputs"]


def test_every_way_of_sending_an_image_equals_the_model_on_the_same_tensor(stack, direct):
    png, jpeg = encode(stop_sign()), encode(noise(64, 48, 1), "JPEG")
    data_uri = "data:image/png;base64," + base64.b64encode(encode(tree())).decode()
    as_json = requests.post(f"{stack.api}/v1/jobs", json={"model": MODEL, "inputs": [
        base64.b64encode(png).decode(), data_uri, base64.b64encode(jpeg).decode()]}, timeout=10)
    outputs = finished(stack, as_json)
    for output, data in zip(outputs, [png, encode(tree()), jpeg]):
        check(output, direct(data))

    multipart = requests.post(f"{stack.api}/v1/jobs", data={"job": json.dumps({
        "model": MODEL, "options": {"top_k": 2}})}, files=[
        ("inputs", ("sign.png", png, "image/png")),
        ("inputs", ("noise.jpg", jpeg, "image/jpeg"))], timeout=10)
    for output, data in zip(finished(stack, multipart), [png, jpeg]):
        want = direct(data)
        top2 = dict(sorted(want.items(), key=lambda kv: kv[1], reverse=True)[:2])
        check(output, top2)

    body = requests.post(f"{stack.api}/v1/jobs", params={"model": MODEL, "priority": "high"},
                         data=jpeg, headers={"Content-Type": "image/jpeg"}, timeout=10)
    (output,) = finished(stack, body)
    check(output, direct(jpeg))


def test_a_drawn_stop_sign_is_red_and_a_tree_is_green(stack):
    r = requests.post(f"{stack.api}/v1/jobs", json={"model": MODEL, "inputs": [
        base64.b64encode(encode(stop_sign(), "JPEG")).decode(),
        base64.b64encode(encode(tree())).decode()]}, timeout=10)
    assert [o["label"] for o in finished(stack, r)] == ["red", "green"]


def png_claiming(width: int, height: int) -> bytes:
    """A PNG header for a width x height picture with almost no data: a decompression bomb."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + \
            struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + \
        chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


def test_bad_images_are_422_naming_each_input(stack):
    good = encode(tree())
    inputs = {
        1: ("not base64 at all!", "not valid base64"),
        2: (b"hello, I am text", "not an image in a supported format"),
        3: (good[: len(good) // 2], "cannot be decoded"),
        4: (encode(tree(), "TIFF"), "not an image in a supported format"),
        5: (encode(Image.new("RGB", (1200, 1000), "blue")), "more pixels than this model takes"),
        6: (png_claiming(100_000, 100_000), "pixels"),
        7: (encode(noise(256, 256, 2)), "this model takes at most 150000"),
    }
    sent = [base64.b64encode(good).decode()] + [
        v if isinstance(v, str) else base64.b64encode(v).decode() for v, _ in inputs.values()]
    r = requests.post(f"{stack.api}/v1/jobs", json={"model": MODEL, "inputs": sent[:8]},
                      timeout=10)
    assert r.status_code == 422, r.text
    fields = r.json()["error"]["fields"]
    assert set(fields) == {f"inputs.{i}" for i in inputs}
    for i, (_value, message) in inputs.items():
        assert message in fields[f"inputs.{i}"][0], (i, fields[f"inputs.{i}"])

    body = requests.post(f"{stack.api}/v1/jobs", params={"model": MODEL}, data=b"GIF89a junk",
                         headers={"Content-Type": "image/gif"}, timeout=10)
    assert body.status_code == 422 and "inputs.0" in body.json()["error"]["fields"]
    job = ("job", (None, json.dumps({"model": MODEL})))
    picture = ("inputs", ("x.png", good, "image/png"))
    empty = requests.post(f"{stack.api}/v1/jobs", files=[job], timeout=10)  # multipart, no image
    assert empty.status_code == 422 and "inputs" in empty.json()["error"]["fields"]
    # Every part is the job's or refused, none dropped unread (the outside attack of session
    # 13: a second `job` part and a part of another name were ignored, an `inputs` field
    # without a filename was "Missing data", a body without ?model "Field may not be null").
    for parts, field, said in [
            ([job, ("job", (None, json.dumps({"model": "tiny-seqcls"}))), picture], "job",
             "one `job` part"),
            ([job, picture, ("evil", ("e.png", good, "image/png"))], "evil", "unknown part"),
            ([job, ("inputs", (None, "hello"))], "inputs", "file parts named `inputs`")]:
        r = requests.post(f"{stack.api}/v1/jobs", files=parts, timeout=10)
        assert r.status_code == 422 and said in r.json()["error"]["fields"][field][0], r.text
    r = requests.post(f"{stack.api}/v1/jobs", data=good, headers={"Content-Type": "image/png"},
                      timeout=10)
    assert r.status_code == 422 and "?model=" in r.json()["error"]["fields"]["model"][0], r.text


class _Pictures(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args) -> None:
        pass


def test_an_image_url_is_fetched_by_the_api_and_inward_urls_are_refused(stack, direct):
    pytest.importorskip("tasks.egress", reason="image URLs are fetched through tasks.egress")
    _Pictures.body = encode(stop_sign())
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Pictures)  # allowed: IQ_IMAGE_URL_ALLOW
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/sign.png"
        (output,) = finished(stack, requests.post(
            f"{stack.api}/v1/jobs", json={"model": MODEL, "inputs": [url]}, timeout=30))
        check(output, direct(_Pictures.body))
    finally:
        server.shutdown()
    # Refused before any connection is made: the address is checked first.
    r = requests.post(f"{stack.api}/v1/jobs", json={"model": MODEL, "inputs": [
        url, "http://169.254.169.254/latest/meta-data/"]}, timeout=30)
    assert r.status_code == 422
    assert set(r.json()["error"]["fields"]) == {"inputs.0", "inputs.1"}  # server gone; refused
    # The address rule's refusal names the setting that allows a host all the same.
    r = requests.post(f"{stack.api}/v1/jobs", json={"model": MODEL, "inputs": [
        "http://169.254.169.254/latest/meta-data/"]}, timeout=30)
    assert r.status_code == 422
    assert "IQ_IMAGE_URL_ALLOW" in r.json()["error"]["fields"]["inputs.0"][0], r.text


def test_a_malformed_image_url_is_422_naming_its_input(stack):
    malformed = ["http://[::1/", "http://[]/", "http://[zz]/", "http://[::1%25%00]/"]
    r = requests.post(f"{stack.api}/v1/jobs", json={"model": MODEL, "inputs": malformed},
                      timeout=30)
    assert r.status_code == 422, r.text
    fields = r.json()["error"]["fields"]
    assert set(fields) == {f"inputs.{i}" for i in range(len(malformed))}
    assert all("not a valid URL" in fields[name][0] for name in fields), fields
