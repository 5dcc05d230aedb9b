"""Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`:
the browser reads NUL-terminated JSON commands on fd 3 and writes its answers on fd 4), so a
test can open a page, run script in it and wait for what it renders, with no driver library.
`make test` installs Debian's `chromium` (scripts/test_tools.py); `require` skips or fails,
saying why, where it is missing."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.support.tools import require


def _at_3_and_4(reading: int, writing: int) -> None:
    """In the browser's process, before it starts: the pipes at fds 3 and 4, where it looks
    for them (first moved above 9, so that neither is overwritten by the other's dup2). The
    test's own descriptors are not inherited (Python opens them close-on-exec)."""
    high = fcntl.fcntl(reading, fcntl.F_DUPFD, 10), fcntl.fcntl(writing, fcntl.F_DUPFD, 10)
    os.dup2(high[0], 3)
    os.dup2(high[1], 4)


class Browser:
    """One headless Chromium and one page in it: `open(url)`, then `evaluate(js)`."""

    def __init__(self, profile: Path):
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        self._log = open(profile.with_suffix(".log"), "wb")
        self.proc = subprocess.Popen(
            [require("chromium"), "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--no-first-run", f"--user-data-dir={profile}", "--remote-debugging-pipe",
             "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log,
            close_fds=False, start_new_session=True,
            preexec_fn=lambda: _at_3_and_4(to_browser_r, from_browser_w))
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self._session = None

    def send(self, method: str, timeout: float = 30, **params) -> dict:
        """One command; its result (an error from the browser raises)."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if self._session:
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buffer:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer to {method} in {timeout} s")
                chunk = os.read(self._from_browser, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"the browser exited: {self.log_tail()}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer["result"]

    def open(self, url: str) -> None:
        """A new page at `url`, which the next commands go to."""
        target = self.send("Target.createTarget", url=url)["targetId"]
        self._session = self.send("Target.attachToTarget", targetId=target,
                                  flatten=True)["sessionId"]

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (awaited when a promise)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float, what: str):
        """Evaluates `expression` until it is truthy (event-driven polling of the page's DOM,
        every 100 ms), and returns that value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not seen in {timeout} s; page text: "
                                     f"{self.evaluate('document.body.innerText')[:1500]!r}")
            time.sleep(0.1)

    def log_tail(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-3000:]

    def close(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        for fd in (self._to_browser, self._from_browser):
            os.close(fd)
        self._log.close()

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
