"""A TCP proxy in front of Redis that can cut a pub/sub message in half: it sends a subscribed
client the first bytes of a message and nothing more on that connection, as a middlebox that
drops the rest of a frame would. A client that reads that socket with no timeout hangs there."""
from __future__ import annotations

import socket
import threading

from scripts.preflight import REDIS_APP_USER
from scripts.stack import free_port
from tests.support.proxy import accept_forever

# The head of a RESP3 push (">3": kind, channel, payload), stopping inside the channel name.
HALF_A_MESSAGE = b">3\r\n$7\r\nmessage\r\n$20\r\nhalf-of-a-chan"


class RedisProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self._server = socket.create_server(("127.0.0.1", free_port()))
        self.port = self._server.getsockname()[1]
        self._lock = threading.Lock()
        self._subscribed: list[tuple[socket.socket, threading.Event]] = []
        threading.Thread(target=accept_forever, args=(self._server, self._serve),
                         daemon=True).start()

    def url(self, password: str) -> str:
        """The application's URL through the proxy."""
        return f"redis://{REDIS_APP_USER}:{password}@127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self._server.close()

    def cut_subscribers(self) -> int:
        """Send every client subscribed so far half a message, and nothing after it."""
        with self._lock:
            cut = list(self._subscribed)
            self._subscribed.clear()
        for client, silenced in cut:
            silenced.set()
            try:
                client.sendall(HALF_A_MESSAGE)
            except OSError:
                pass
        return len(cut)

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        silenced = threading.Event()
        threading.Thread(target=self._down, args=(upstream, client, silenced),
                         daemon=True).start()
        try:
            while True:
                data = client.recv(65536)
                if not data:
                    break
                if b"SUBSCRIBE" in data.upper():
                    with self._lock:
                        self._subscribed.append((client, silenced))
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                try:
                    s.close()
                except OSError:
                    pass

    @staticmethod
    def _down(upstream: socket.socket, client: socket.socket, silenced: threading.Event) -> None:
        try:
            while True:
                data = upstream.recv(65536)
                if not data:
                    break
                if silenced.is_set():
                    continue  # the rest of the message never comes
                client.sendall(data)
        except OSError:
            pass
