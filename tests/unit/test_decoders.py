"""The decoder processes (app/decoder_pool.py) and what they refuse before decoding
(app/decoder.py): real decoder processes, real Pillow, hostile images made on the fly."""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

import app.decoder_pool as decoders_module
from app.decoder_pool import DECODER, WAITING_PER_DECODER, Budget, DecoderPool, DecodersBusy, \
    _Turns
from app.decoder import ANSWER, DECODER_UID_BASE, MAX_JPEG_SCANS, Limits, Refused, \
    jpeg_scans, picture
from app.image_errors import ImageRefused
from bench.hostile_images import animated_webp, as_mpo, chunk_before_ihdr, junk_after_app0, \
    one_bit_png, progressive_jpeg, rgba16_png
from config import load_settings

DEFAULTS = load_settings(environ={})
LIMITS = Limits(("JPEG", "PNG", "WEBP", "GIF", "BMP"), 40_000_000, (256,), (224, 224),
                "bilinear")


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def pool(**changes) -> DecoderPool:
    values = {"size": DEFAULTS.image_decoders, "timeout_s": DEFAULTS.image_decode_timeout_s,
              "memory_mb": DEFAULTS.image_decode_memory_mb, **changes}
    return DecoderPool(**values)


def test_scans_are_counted_by_walking_the_markers():
    assert jpeg_scans(encode(Image.new("RGB", (64, 64), "red"), "JPEG"), 100) == 1
    progressive = encode(Image.new("RGB", (64, 64), "red"), "JPEG", progressive=True)
    many = progressive_jpeg(300, side=64)
    assert 1 < jpeg_scans(progressive, 100) < 20
    assert jpeg_scans(many, 1000) == 300 and jpeg_scans(many, 100) == 101
    # As libjpeg reads them: past a stray byte between segments, and in each JPEG of an MPO.
    assert jpeg_scans(junk_after_app0(many), 1000) == 300
    assert jpeg_scans(as_mpo(many), 1000) == 600


TOO_MANY_SCANS = f"more than {MAX_JPEG_SCANS} scans"
SAMPLES = "298 MiB of samples; this model takes at most 153 MiB"


@pytest.mark.parametrize("make, reason", [
    (lambda: progressive_jpeg(MAX_JPEG_SCANS + 1, side=64), TOO_MANY_SCANS),
    # The scan counter's bypasses: a stray byte after APP0, an MPF segment (Pillow: MPO).
    (lambda: junk_after_app0(progressive_jpeg(MAX_JPEG_SCANS + 1, side=64)), TOO_MANY_SCANS),
    (lambda: as_mpo(progressive_jpeg(MAX_JPEG_SCANS + 1, side=64)), TOO_MANY_SCANS),
    (lambda: as_mpo(junk_after_app0(progressive_jpeg(3000, side=256))), TOO_MANY_SCANS),
    (rgba16_png, SAMPLES),
    # The sample check's bypass: a chunk before IHDR where a fixed offset read its depth.
    (lambda: chunk_before_ihdr(rgba16_png()), SAMPLES),
    (animated_webp, "animation on a 6245x6245 canvas"),
    (lambda: encode(Image.new("L", (7000, 7000)), "PNG"), "49000000 pixels"),
])
@pytest.mark.parametrize("padding", [0, 100_000])
def test_each_hostile_form_is_refused_before_decoding_padded_or_not(make, reason, padding):
    data = make() + bytes(padding)  # zeros after the image change no refusal
    started = time.monotonic()
    with pytest.raises(Refused, match=reason):
        picture(data, LIMITS)
    assert time.monotonic() - started < 0.5  # from the header: nothing was decoded


def test_a_blank_39_mp_one_bit_png_is_bounded_by_the_deadline_padded_or_not():
    """No rule of pixels per byte of the file (padding defeated it): what the header cannot
    refuse is decoded within the deadline, or refused at it."""
    decoders = pool(size=1)
    for data in (one_bit_png(), one_bit_png() + bytes(40_000)):
        started = time.monotonic()
        try:
            assert len(decoders.picture(data, LIMITS)) == 224 * 224 * 3
        except ImageRefused as refused:
            assert "took longer than 5s" in str(refused)
        assert time.monotonic() - started < DEFAULTS.image_decode_timeout_s + 1


def test_a_good_image_is_decoded_resized_and_cropped_in_a_decoder():
    decoders = pool()
    red = decoders.picture(encode(Image.new("RGB", (640, 480), (250, 0, 0)), "JPEG"), LIMITS)
    assert len(red) == 224 * 224 * 3
    assert red[:3] == picture(encode(Image.new("RGB", (640, 480), (250, 0, 0)), "JPEG"),
                              LIMITS)[:3]


# Its 0.3 s deadline also covers the new decoder's start (a Python process): a busy neighbour
# stretches that past it.
@pytest.mark.serial
def test_an_image_past_its_deadline_is_refused_and_its_decoder_replaced():
    slow = progressive_jpeg(MAX_JPEG_SCANS)  # within the cap: 64 passes over 36 MP
    decoders = pool(size=1, timeout_s=0.3)  # shortened: the default lets this one finish
    started = time.monotonic()
    with pytest.raises(ImageRefused, match="took longer than 0.3s to decode"):
        decoders.picture(slow, LIMITS)
    assert time.monotonic() - started < 2
    good = encode(Image.new("RGB", (64, 64), "blue"), "PNG")
    assert len(decoders.picture(good, LIMITS)) == 224 * 224 * 3  # a new decoder


@pytest.mark.serial  # it decodes 36 MP within the default 5 s: busy neighbours stretch that
def test_an_image_that_needs_more_memory_than_a_decoder_has_is_refused():
    big = encode(Image.new("RGBA", (6000, 6000), (10, 200, 30, 255)), "PNG")
    small = pool(size=1, memory_mb=256)
    with pytest.raises(ImageRefused, match="more memory"):
        small.picture(big, LIMITS)
    assert len(small.picture(encode(Image.new("RGB", (64, 64)), "PNG"), LIMITS)) == 224 * 224 * 3
    assert len(pool(size=1).picture(big, LIMITS)) == 224 * 224 * 3  # the default memory


def test_a_full_pool_answers_busy_at_once():
    decoders = pool(size=1, timeout_s=3)
    slow = progressive_jpeg(MAX_JPEG_SCANS)
    outcomes: list[str] = []

    def send() -> None:
        try:
            decoders.picture(slow, LIMITS)
            outcomes.append("decoded")
        except ImageRefused:
            outcomes.append("refused")
        except DecodersBusy:
            outcomes.append("busy")

    threads = [threading.Thread(target=send) for _ in range(WAITING_PER_DECODER + 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # One decodes, four wait (and time out waiting, or get their turn), the rest are told
    # at once that the pool is full.
    assert outcomes.count("busy") >= 2, outcomes


def medium_slow() -> bytes:
    """Accepted, and a fraction of a second to a second of a decoder's time."""
    return progressive_jpeg(MAX_JPEG_SCANS, side=1500)


def test_a_freed_decoder_goes_to_the_longest_waiting_request():
    """One request decodes image after image; another asks for one decoder meanwhile: it is
    served after the image being decoded, not after the whole request (a freed decoder never
    goes back to the request that freed it while another waits)."""
    decoders = pool(size=1)
    done: list[str] = []
    started = threading.Event()

    def flood() -> None:
        for n in range(6):
            started.set()
            decoders.picture(medium_slow(), LIMITS)
            done.append(f"a{n}")

    flooder = threading.Thread(target=flood)
    flooder.start()
    started.wait(10)
    decoders.picture(encode(Image.new("RGB", (64, 64), "green"), "PNG"), LIMITS)
    done.append("b")
    flooder.join()
    assert done.index("b") <= 2, done  # after the image in hand (and, at worst, the next)


def test_one_owner_holds_at_most_its_share_of_the_decoders():
    turns = _Turns(size=2, per_owner=1, max_waiting=8)
    turns.take("a", 1)
    with pytest.raises(DecodersBusy):  # a free decoder, but not for "a"
        turns.take("a", 0.2)
    turns.take("b", 0.2)  # at once: the other decoder is "b"'s to take
    turns.give_back("a")
    turns.take("a", 0.2)
    turns.give_back("b")
    turns.take(None, 0.2)  # keys off: no owner, no cap


def test_one_owner_holds_at_most_its_share_of_the_waiting_line():
    """The re-attack on issue 26 (F1): one key with a decoder busy and the shared line full of
    its waiters (which its cap keeps from being served) got every other key a 503 while the
    other decoder sat idle. Now a key's waiters are capped too: the rest are told at once, and
    another key finds room and the free decoder."""
    turns = _Turns(size=2, per_owner=1, max_waiting=2 * WAITING_PER_DECODER)
    turns.take("a", 1)  # decoding its slow image
    outcomes: list[str] = []

    def wait_in_line() -> None:
        try:
            turns.take("a", 30)
            outcomes.append("served")
            turns.give_back("a")
        except DecodersBusy:
            outcomes.append("busy")

    flood = [threading.Thread(target=wait_in_line) for _ in range(turns.max_waiting)]
    for thread in flood:
        thread.start()
    deadline = time.monotonic() + 10
    while outcomes.count("busy") < turns.max_waiting - WAITING_PER_DECODER:
        assert time.monotonic() < deadline, outcomes
        time.sleep(0.01)
    assert len(turns._line) == WAITING_PER_DECODER  # "a"'s share of the line, no more
    turns.take("b", 0.5)  # room in the line, and the decoder "a"'s cap leaves free
    turns.give_back("b")
    turns.give_back("a")  # "a"'s waiters are served one after another
    for thread in flood:
        thread.join()
    assert outcomes.count("served") == WAITING_PER_DECODER, outcomes


def test_a_requests_images_share_one_decoding_budget():
    """A request's images share one budget of decoding seconds (shortened here to 2 s; the
    default, 10 s, is the hostile-image test's): each image decoded spends some of it, the image
    in hand when it runs out is given only what is left and stopped there, and the rest are
    refused undecoded. The image in hand never finishes, however fast or loaded the machine:
    its decoder is stopped (SIGSTOP), as slow as a decode can be."""
    decoders, budget = pool(size=1), Budget(2.0)
    small = encode(Image.new("RGB", (64, 64), "green"), "PNG")  # milliseconds, even loaded
    spent = [budget.spent]
    for _ in range(3):
        assert len(decoders.picture(small, LIMITS, budget=budget)) == 224 * 224 * 3
        spent.append(budget.spent)
    assert spent == sorted(set(spent)) and budget.left > 0, spent  # each image counted
    (decoder,) = decoders._idle
    os.kill(decoder.proc.pid, signal.SIGSTOP)
    spent_out = "not decoded: the job's images took their 2s of decoding in all"
    with pytest.raises(ImageRefused) as refused:
        decoders.picture(small, LIMITS, budget=budget)
    # What was left of the budget, not the image's own 5 s (that refusal says "took longer").
    assert str(refused.value) == spent_out and budget.left <= 0, budget
    assert decoder.proc.returncode == -signal.SIGKILL and decoders._idle == []  # replaced
    stopped_at = budget.spent
    for _ in range(2):  # the rest: refused before a decoder is taken, and nothing spent
        with pytest.raises(ImageRefused) as refused:
            decoders.picture(small, LIMITS, budget=budget)
        assert str(refused.value) == spent_out
    assert decoders._idle == [] and budget.spent == stopped_at, budget
    # Another request has a budget of its own, on a new decoder.
    assert len(decoders.picture(small, LIMITS, budget=Budget(2.0))) == 224 * 224 * 3


def test_a_jpeg_cut_in_its_header_is_refused_as_corrupt_and_its_decoder_lives_on():
    """The outside attack of session 13: the first half of a small JPEG made Image.open raise
    OSError, which ended the decoder (422 "the decoder died"); a flood of such files kept
    every decoder restarting, and other clients' good images got 503."""
    whole = encode(Image.new("RGB", (64, 48), "red"), "JPEG")
    cut = whole[:len(whole) // 2]
    with pytest.raises(Refused) as refused:
        picture(cut, LIMITS)  # in this process: what the decoder raises
    assert refused.value.code == "corrupt", refused.value
    decoders = pool(size=1)
    decoders.picture(whole, LIMITS)
    [decoder] = decoders._idle
    with pytest.raises(ImageRefused, match=r"^the image cannot be decoded \(truncated or "):
        decoders.picture(cut, LIMITS)
    assert decoders._idle == [decoder] and decoder.proc.poll() is None  # the same one, alive
    assert len(decoders.picture(whole, LIMITS)) == 224 * 224 * 3


def test_a_refusal_reaches_the_client_in_the_apis_words_whatever_the_decoder_says(
        tmp_path, monkeypatch):
    """The re-attack on issue 26 (F5): a decoder's refusal text went into the client's 422
    word for word, a way out for whatever code a hostile image got running in a decoder."""
    truncated = encode(Image.new("RGB", (64, 64), "red"), "PNG")[:-30]
    with pytest.raises(ImageRefused) as refused:
        pool(size=1).picture(truncated, LIMITS)
    assert str(refused.value) == "the image cannot be decoded (truncated or corrupt)"
    lying = tmp_path / "lying_decoder.py"  # what a decoder taken over could answer
    lying.write_text(LYING_DECODER)
    monkeypatch.setattr(decoders_module, "DECODER", str(lying))
    with pytest.raises(ImageRefused) as refused:
        pool(size=1).picture(truncated, LIMITS)
    assert str(refused.value) == "the image was refused by its decoder"


LYING_DECODER = """
import json, struct, sys
hello = json.dumps({"uid": 0, "network": "none", "hidden": True, "no_new_privs": True})
sys.stdout.buffer.write(struct.pack(">BI", 1, len(hello)) + hello.encode())
sys.stdout.buffer.flush()
while head := sys.stdin.buffer.read(8):
    sys.stdin.buffer.read(sum(struct.unpack(">II", head)))
    said = b"var/secrets/redis-password: admin-password-XYZ"
    sys.stdout.buffer.write(struct.pack(">BI", 0, len(said)) + said)
    sys.stdout.buffer.flush()
"""


def secrets_folder(tmp_path) -> Path:
    """A var dir whose secret anyone could read, but for the decoder's mount namespace."""
    var = tmp_path / "var"
    (var / "secrets").mkdir(parents=True)
    (var / "secrets" / "redis-password").write_text("admin-password-XYZ\n")
    for path in (tmp_path, var, var / "secrets"):
        path.chmod(0o755)
    (var / "secrets" / "redis-password").chmod(0o644)
    return var


@pytest.mark.skipif(os.getuid() != 0, reason="a user of its own needs an API run as root")
def test_a_decoder_of_an_api_run_as_root_is_a_user_of_its_own_without_network_or_secrets(
        tmp_path, monkeypatch):
    var = secrets_folder(tmp_path)
    monkeypatch.setenv("IQ_VAR_DIR", str(var))
    decoders = pool(size=1)
    decoders.picture(encode(Image.new("RGB", (64, 64), "blue"), "PNG"), LIMITS)
    (decoder,) = decoders._idle
    pid = decoder.proc.pid
    own = DECODER_UID_BASE + pid  # no passwd entry, no other process: none it may signal
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    assert status["Uid"].split() == [str(own)] * 4
    assert status["Gid"].split() == [str(own)] * 4
    assert status["Groups"].split() == []
    assert status["NoNewPrivs"].strip() == "1" and int(status["CapEff"], 16) == 0
    assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    assert os.readlink(f"/proc/{pid}/cwd") == "/"
    # What it sees there: an empty folder where the secrets are, and no other process.
    assert os.listdir(f"/proc/{pid}/root{var}") == [] and os.listdir(var) == ["secrets"]
    assert os.listdir(f"/proc/{pid}/root/proc") == []
    assert decoder.confinement == {"uid": own, "network": "none", "hidden": True,
                                   "no_new_privs": True}
    # Still decodes: nothing it needs was given up.
    assert len(decoders.picture(encode(Image.new("RGB", (640, 480)), "JPEG"), LIMITS)) == \
        224 * 224 * 3


@pytest.mark.skipif(os.getuid() != 0, reason="starts a decoder as another user, as root")
def test_a_decoder_of_an_api_run_as_an_ordinary_user_sees_neither_its_secrets_nor_proc():
    """An API run as an ordinary user (uid 4242 here) keeps its uid in its decoders: they
    hide the var dir and /proc in a user and mount namespace of their own instead."""
    reachable = Path(tempfile.mkdtemp())  # pytest's tmp_path is root's alone
    try:
        confined_as(4242, secrets_folder(reachable))
    finally:
        shutil.rmtree(reachable)


def confined_as(uid: int, var: Path) -> None:
    """A decoder started by `uid` (whose secret it is), told to hide `var`."""
    os.chown(var / "secrets" / "redis-password", uid, uid)
    as_uid = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    decoder = subprocess.Popen([*as_uid, sys.executable, "-I", DECODER, "512", str(var)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        _kind, size = ANSWER.unpack(decoder.stdout.read(ANSWER.size))
        held = json.loads(decoder.stdout.read(size))
        assert held == {"uid": uid, "network": "none", "hidden": True, "no_new_privs": True}
        assert os.listdir(f"/proc/{decoder.pid}/root{var}") == []
        assert os.listdir(f"/proc/{decoder.pid}/root/proc") == []
    finally:
        decoder.kill()
        decoder.wait()
