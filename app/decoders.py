"""A small pool of decoder processes (app/decoding.py) per API process, so that no image, however
hostile, blocks the requests beside it: the API only writes the image's bytes to a decoder's
pipe and waits for its answer, which under gunicorn's gevent worker yields to every other
request (the standard library's threading, subprocess and selectors are gevent's there; without
gevent, a waiting thread waits).

* At most `size` images are decoded at once, one per decoder; `size` × 4 more may wait for a
  decoder, each for at most `timeout_s`. Past that the pool is full: DecodersBusy, a `503`.
* Each image has `timeout_s`: a decoder that has not answered by then is killed and replaced,
  and the image is refused.
* Each decoder's address space is capped at `memory_mb`: a picture that needs more is refused
  (or, should the decoder die of it, refused all the same).

Decoders start on first use and stop when the API process does (their stdin closes).
"""
from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from app.decoding import ANSWER, OK, REQUEST, Limits
from app.image_errors import ImageRefused

DECODER = str(Path(__file__).with_name("decoding.py"))
WAITING_PER_DECODER = 4


class DecodersBusy(Exception):
    """Every decoder is busy and the waiting line is full (or did not move in time)."""


class _Late(Exception):
    pass


class _Decoder:
    """One decoder process and the non-blocking ends of its pipes."""

    def __init__(self, memory_mb: int) -> None:
        # Isolated (-I): no PYTHON* variables, no user site, and not this folder on sys.path;
        # an environment with nothing of the API's in it.
        self.proc = subprocess.Popen(
            [sys.executable, "-I", DECODER, str(memory_mb)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            close_fds=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.fd_in, self.fd_out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self.fd_in, False)
        os.set_blocking(self.fd_out, False)

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
    def __init__(self, size: int, timeout_s: float, memory_mb: int) -> None:
        self.size, self.timeout_s, self.memory_mb = size, timeout_s, memory_mb
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._waiting = 0
        self._idle: list[_Decoder] = []

    @contextmanager
    def _slot(self) -> Iterator[None]:
        with self._lock:
            if self._waiting >= self.size * WAITING_PER_DECODER:
                raise DecodersBusy()
            self._waiting += 1
        try:
            taken = self._slots.acquire(timeout=self.timeout_s)
        finally:
            with self._lock:
                self._waiting -= 1
        if not taken:
            raise DecodersBusy()
        try:
            yield
        finally:
            self._slots.release()

    def picture(self, data: bytes, limits: Limits) -> bytes:
        """The model's input picture (raw RGB) made from `data` by a decoder; ImageRefused
        when the image is refused, too slow or too large to decode; DecodersBusy."""
        with self._slot():
            with self._lock:
                decoder = self._idle.pop() if self._idle else None
            decoder = decoder or _Decoder(self.memory_mb)
            try:
                kind, body = decoder.ask(limits.to_json(), data,
                                         time.monotonic() + self.timeout_s)
            except _Late:
                decoder.stop()
                raise ImageRefused(f"the image took longer than {self.timeout_s:g}s to "
                                   "decode") from None
            except (OSError, EOFError):
                decoder.stop()
                raise ImageRefused("the decoder died on this image (out of its "
                                   f"{self.memory_mb} MiB of memory, or a fault of the "
                                   "decoder)") from None
            except BaseException:  # the request itself was cut short: its answer is unread
                decoder.stop()
                raise
            with self._lock:
                self._idle.append(decoder)
        if kind != OK:
            raise ImageRefused(body.decode())
        return body
