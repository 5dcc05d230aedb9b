"""A small pool of decoder processes (app/decoder.py) per API process, so that no image, however
hostile, blocks the requests beside it: the API only writes the image's bytes to a decoder's
pipe and waits for its answer, which under gunicorn's gevent worker yields to every other
request (the standard library's threading, subprocess and selectors are gevent's there; without
gevent, a waiting thread waits).

* Decoders are handed out first come, first served (`_Turns`): a freed decoder goes to the
  image that has waited longest, never back to the request that freed it. With API keys, one
  key holds at most `per_owner` decoders at once; the others stay free for other keys.
* At most `size` images are decoded at once, one per decoder; `size` × 4 more may wait for a
  decoder, each for at most `timeout_s`, and of those at most `per_owner` × 4 for one key, so
  that one key never fills the line: another key always finds room, and the decoders the
  first key's cap leaves free serve it. Past that the pool is full (for that key):
  DecodersBusy, a `503`.
* Each image has `timeout_s`, and a request's images share one `Budget` of decoding seconds:
  a decoder that has not answered by the earlier of the two is killed and replaced, and the
  image is refused; once the budget is spent, the request's other images are refused undecoded.
* Each decoder's address space is capped at `memory_mb`: a picture that needs more is refused
  (or, should the decoder die of it, refused all the same).

A decoder's refusal is a code (app/decoder.py's CODES); the client's message is worded here,
from the model's limits, so that nothing a decoder says reaches a client (`refusal`).

Decoders start on first use and stop when the API process does (their stdin closes). A decoder
serves one image at a time, of any key, and keeps nothing between images.
"""
from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from app.decoder import ANSWER, MAX_JPEG_SCANS, OK, REQUEST, Limits
from app.image_errors import ImageRefused

DECODER = str(Path(__file__).with_name("decoder.py"))
# Where make run keeps the secrets and Redis's files: out of its decoders' sight (with /proc).
HIDDEN_FOLDERS = ("IQ_VAR_DIR", "IQ_REDIS_DIR")
WAITING_PER_DECODER = 4
STARTUP_S = 30.0  # a decoder's start (Python, Pillow, its confinement): not an image's time
logger = logging.getLogger(__name__)


class DecodersBusy(Exception):
    """Every decoder is busy and the waiting line is full (or did not move in time)."""


@dataclass
class Budget:
    """The decoding seconds a request's images share (waiting for a decoder spends none)."""
    seconds: float
    spent: float = 0.0

    @property
    def left(self) -> float:
        return self.seconds - self.spent


@dataclass(eq=False)
class _Waiter:
    owner: str | None
    event: threading.Event = field(default_factory=threading.Event)
    granted: bool = False


class _Turns:
    """`size` decoders, handed out in the order asked for, at most `per_owner` to one owner
    (None: an owner without a cap, as every request is when keys are off). At most
    `max_waiting` wait in all, and `per_owner` × WAITING_PER_DECODER of one owner's."""

    def __init__(self, size: int, per_owner: int, max_waiting: int) -> None:
        self.size, self.per_owner, self.max_waiting = size, per_owner, max_waiting
        self.owner_waiting = min(max_waiting, per_owner * WAITING_PER_DECODER)
        self._lock = threading.Lock()
        self._free = size
        self._in_use: Counter[str] = Counter()
        self._waiting: Counter[str] = Counter()
        self._line: deque[_Waiter] = deque()

    def _fits(self, owner: str | None) -> bool:
        return owner is None or self._in_use[owner] < self.per_owner

    def _hand_out(self) -> None:
        """Free decoders to the longest waiting whose owner is under its cap (lock held)."""
        for waiter in list(self._line):
            if not self._free:
                return
            if self._fits(waiter.owner):
                self._leave(waiter)
                self._free -= 1
                if waiter.owner is not None:
                    self._in_use[waiter.owner] += 1
                waiter.granted = True
                waiter.event.set()

    def _leave(self, waiter: _Waiter) -> None:
        """(lock held)"""
        self._line.remove(waiter)
        if waiter.owner is not None:
            self._waiting[waiter.owner] -= 1
            if not self._waiting[waiter.owner]:
                del self._waiting[waiter.owner]

    def take(self, owner: str | None, timeout_s: float) -> None:
        """A decoder for `owner`, or DecodersBusy: the line is full, or holds the owner's
        share of it, or did not reach this turn within `timeout_s`."""
        waiter = _Waiter(owner)
        with self._lock:
            if len(self._line) >= self.max_waiting or (
                    owner is not None and self._waiting[owner] >= self.owner_waiting):
                raise DecodersBusy()
            self._line.append(waiter)
            if owner is not None:
                self._waiting[owner] += 1
            self._hand_out()
        waiter.event.wait(timeout_s)
        with self._lock:
            if not waiter.granted:
                self._leave(waiter)
                raise DecodersBusy()

    def give_back(self, owner: str | None) -> None:
        with self._lock:
            self._free += 1
            if owner is not None:
                self._in_use[owner] -= 1
                if not self._in_use[owner]:
                    del self._in_use[owner]
            self._hand_out()


class _Late(Exception):
    pass


class _Decoder:
    """One decoder process and the non-blocking ends of its pipes."""

    def __init__(self, memory_mb: int) -> None:
        # Isolated (-I): no PYTHON* variables, no user site, and not this folder on sys.path;
        # an environment with nothing of the API's in it.
        hidden = [os.path.abspath(os.environ[name]) for name in HIDDEN_FOLDERS
                  if os.environ.get(name)]
        self.proc = subprocess.Popen(
            [sys.executable, "-I", DECODER, str(memory_mb), *hidden], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            close_fds=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.fd_in, self.fd_out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self.fd_in, False)
        os.set_blocking(self.fd_out, False)
        try:  # its first answer: what it gave up (app/decoder.py's confine)
            _kind, size = ANSWER.unpack(self._receive(ANSWER.size, time.monotonic() + STARTUP_S))
            self.confinement = json.loads(self._receive(size, time.monotonic() + STARTUP_S))
        except (_Late, OSError, EOFError, ValueError):
            self.stop()
            logger.error("an image decoder did not start (exit status %s)", self.proc.returncode)
            raise DecodersBusy() from None

    def _wait(self, fd: int, event: int, deadline: float) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(fd, event)
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                raise _Late()

    def _send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            self._wait(self.fd_in, selectors.EVENT_WRITE, deadline)
            try:
                view = view[os.write(self.fd_in, view):]
            except BlockingIOError:
                continue

    def _receive(self, size: int, deadline: float) -> bytes:
        received = bytearray()
        while len(received) < size:
            self._wait(self.fd_out, selectors.EVENT_READ, deadline)
            try:
                chunk = os.read(self.fd_out, min(size - len(received), 1 << 20))
            except BlockingIOError:
                continue
            if not chunk:
                raise EOFError("the decoder closed its output")
            received += chunk
        return bytes(received)

    def ask(self, header: bytes, data: bytes, deadline: float) -> tuple[int, bytes]:
        self._send(REQUEST.pack(len(header), len(data)) + header + data, deadline)
        kind, size = ANSWER.unpack(self._receive(ANSWER.size, deadline))
        return kind, self._receive(size, deadline)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class DecoderPool:
    def __init__(self, size: int, timeout_s: float, memory_mb: int,
                 per_owner: int | None = None) -> None:
        self.size, self.timeout_s, self.memory_mb = size, timeout_s, memory_mb
        self._turns = _Turns(size, per_owner or size, size * WAITING_PER_DECODER)
        self._lock = threading.Lock()
        self._idle: list[_Decoder] = []
        self._warned = False

    @contextmanager
    def _decoder(self, owner: str | None) -> Iterator[_Decoder]:
        self._turns.take(owner, 2 * self.timeout_s)  # its turn comes within two decodes
        try:
            with self._lock:
                decoder = self._idle.pop() if self._idle else None
            decoder = decoder or self._start()
            yield decoder
            with self._lock:
                self._idle.append(decoder)
        finally:
            self._turns.give_back(owner)

    def _start(self) -> _Decoder:
        decoder = _Decoder(self.memory_mb)
        held = decoder.confinement
        if not self._warned and (held["network"] != "none" or not held["no_new_privs"]
                                 or not held["hidden"]):
            self._warned = True  # once per API process
            logger.warning("image decoders run with more than they need: network %s, "
                           "no_new_privs %s, var dir and /proc hidden %s (docs/security.md)",
                           held["network"], held["no_new_privs"], held["hidden"])
        return decoder

    def picture(self, data: bytes, limits: Limits, owner: str | None = None,
                budget: Budget | None = None) -> bytes:
        """The model's input picture (raw RGB) made from `data` by a decoder; ImageRefused
        when the image is refused, too slow or too large to decode, or the request's `budget`
        is spent; DecodersBusy. `owner`: the API key whose decoders it counts against."""
        budget = budget or Budget(self.timeout_s)
        if budget.left <= 0:
            raise _spent(budget)
        with self._decoder(owner) as decoder:
            limit = min(self.timeout_s, budget.left)
            started = time.monotonic()
            try:
                try:
                    kind, body = decoder.ask(limits.to_json(), data, started + limit)
                finally:
                    budget.spent += time.monotonic() - started
            except _Late:
                decoder.stop()
                raise (_spent(budget) if limit < self.timeout_s else ImageRefused(
                    f"the image took longer than {self.timeout_s:g}s to decode")) from None
            except (OSError, EOFError):
                decoder.stop()
                raise ImageRefused("the decoder died on this image (out of its "
                                   f"{self.memory_mb} MiB of memory, or a fault of the "
                                   "decoder)") from None
            except BaseException:  # the request itself was cut short: its answer is unread
                decoder.stop()
                raise
        if kind != OK:
            raise ImageRefused(refusal(body, limits))
        return body


def refusal(code: bytes, limits: Limits) -> str:
    """The client's message for a decoder's refusal `code`: words and figures of the API's own,
    whatever the decoder answered."""
    most = limits.max_pixels
    messages = {
        b"format": f"not an image in a supported format ({', '.join(limits.formats)})",
        b"pixels": f"the image has more pixels than this model takes (at most {most})",
        b"samples": f"the image holds more MiB of samples than this model takes (at most "
                    f"{4 * most / 2**20:.0f} MiB, as in 8-bit RGBA at {most} pixels)",
        b"animation": f"the image is an animation on a canvas of more than {most // 4} pixels, "
                      "the most an animation may have",
        b"scans": f"the JPEG has more than {MAX_JPEG_SCANS} scans",
        b"memory": "the image needs more memory to decode than a decoder may use",
        b"corrupt": "the image cannot be decoded (truncated or corrupt)",
    }
    return messages.get(code, "the image was refused by its decoder")


def _spent(budget: Budget) -> ImageRefused:
    return ImageRefused(f"not decoded: the job's images took their {budget.seconds:g}s of "
                        "decoding in all")
