"""HTTP endpoints that outbound requests (webhooks, tasks.egress) are sent to in tests: a
recording receiver, a tarpit that answers one byte every few seconds, and the docs' own
webhook receiver code (docs/webhooks.md)."""
from __future__ import annotations

import re
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

WEBHOOKS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "webhooks.md"


def readme_receiver() -> dict:
    """The receiver-side check of docs/webhooks.md, run as it is written: its `verify`,
    `Duplicate`, `seen_ids`."""
    text = WEBHOOKS_PAGE.read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "def verify(" in b]
    namespace: dict = {}
    exec(compile(block, "docs/webhooks.md (webhook receiver)", "exec"), namespace)
    return namespace


class Receiver:
    """Records every request; answers 500 for the first `failures`, then `status` (with a
    Location for 3xx) and `body`."""

    def __init__(self, status: int = 204, failures: int = 0, host: str = "127.0.0.1",
                 port: int = 0, tls: ssl.SSLContext | None = None, body: bytes = b"") -> None:
        self.status, self.failures, self.body = status, failures, body
        self.calls: list[dict] = []
        self.server_names: list[str | None] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.calls.append({"path": self.path, "body": body,
                                       "headers": {k.lower(): v for k, v in self.headers.items()}})
                failing = len(receiver.calls) <= receiver.failures
                self.send_response(500 if failing else receiver.status)
                if 300 <= receiver.status < 400:
                    self.send_header("Location", "http://127.0.0.1:1/elsewhere")
                self.send_header("Content-Length", str(len(receiver.body)))
                self.end_headers()
                self.wfile.write(receiver.body)

            do_GET = do_POST = _answer  # noqa: N815 - http.server's names

            def log_message(self, *_args) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        if tls is not None:
            tls.sni_callback = lambda _sock, name, _ctx: self.server_names.append(name)
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_port
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://{host}:{self.port}/hook"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Tarpit:
    """Accepts connections, reads the request, then answers a status line one byte every
    `interval` seconds, for as long as the client stays. Counts what it saw."""

    def __init__(self, interval: float, host: str = "127.0.0.1") -> None:
        self.interval = interval
        self.accepted = 0
        self.bytes_sent = 0
        self.ended = 0  # connections the client closed while the tarpit was open
        self.most_open = 0  # the most connections open at once
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.create_server((host, 0))
        self.url = f"http://{host}:{self._listener.getsockname()[1]}/hook"
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def open(self) -> int:
        with self._lock:
            return len(self._open)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                self._open.add(conn)
                self.most_open = max(self.most_open, len(self._open))
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        try:
            conn.recv(65_536)
            for byte in b"HTTP/1.1 200 OK\r\n" * 1000:
                if self._stop.wait(self.interval):
                    return
                conn.sendall(bytes([byte]))
                with self._lock:
                    self.bytes_sent += 1
        except OSError:
            if not self._stop.is_set():
                with self._lock:
                    self.ended += 1
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        with self._lock:
            for conn in self._open:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

