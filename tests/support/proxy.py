"""A TCP proxy in front of the API that can lose answers: the request reaches the API, which
acts on it and starts answering, and then the client's connection is closed without a byte of
the answer, as a dropped connection or a proxy restart does. Every request line and
Idempotency-Key that passes is recorded."""
from __future__ import annotations

import re
import socket
import threading

from scripts.stack import free_port

_HEADERS_END = b"\r\n\r\n"


class LossyProxy:
    def __init__(self, upstream_port: int, lose: int = 0) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.lose = lose  # answers still to lose, one connection each
        self.lost = 0
        self.requests: list[tuple[str, str | None]] = []  # (request line, Idempotency-Key)
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", free_port()))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=accept_forever, args=(self._server, self._serve),
                         daemon=True).start()

    def close(self) -> None:
        self._server.close()

    def _record(self, head: bytes) -> None:
        text = head.decode("latin-1")
        key = re.search(r"(?im)^idempotency-key:\s*(\S+)", text)
        with self._lock:
            self.requests.append((text.split("\r\n", 1)[0], key.group(1) if key else None))

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.upstream)
        with client, upstream:
            first = _read_request(client)
            if not first:
                return
            self._record(first)
            upstream.sendall(first)
            with self._lock:
                lose, self.lose = self.lose > 0, max(self.lose - 1, 0)
            if lose:
                upstream.recv(1)  # the API has acted and begun its answer: lose it
                with self._lock:
                    self.lost += 1
                return
            back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
            back.start()
            while True:  # later requests on this keep-alive connection
                request = _read_request(client)
                if not request:
                    break
                self._record(request)
                upstream.sendall(request)
            upstream.shutdown(socket.SHUT_WR)
            back.join(30)


def _read_request(sock: socket.socket) -> bytes:
    """One whole HTTP request (head and Content-Length body), or b"" at end of stream."""
    data = b""
    while _HEADERS_END not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(_HEADERS_END)
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    need = int(length.group(1)) if length else 0
    while len(body) < need:
        chunk = sock.recv(65536)
        if not chunk:
            return b""
        body += chunk
    return head + _HEADERS_END + body


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    except OSError:
        pass


def accept_forever(server: socket.socket, serve) -> None:
    """Hand each connection `server` accepts to `serve` on a thread of its own, until the
    server socket is closed. Start it on a daemon thread."""
    while True:
        try:
            client, _ = server.accept()
        except OSError:
            return
        threading.Thread(target=serve, args=(client,), daemon=True).start()
