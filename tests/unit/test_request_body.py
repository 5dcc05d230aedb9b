"""The API's guarded request bodies (app/request_body.py): a body with a Content-Length is not
asked for more once that much is read (werkzeug reads once more to find the end, which cost
a gevent Timeout and a trip through gunicorn's reader a request); one without is read to its
end as before."""
from __future__ import annotations

import io

from app.request_body import GuardedBodies


class Counted(io.BytesIO):
    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.reads = 0

    def read(self, *args):
        self.reads += 1
        return super().read(*args)


def _read_all(length: str | None, body: bytes = b'{"model": "echo"}') -> tuple[bytes, int]:
    """The body as a WSGI app reading to its end (as werkzeug's readall does) gets it, and the
    reads asked of the server's stream."""
    stream, got = Counted(body), []

    def app(environ, start_response):
        while chunk := environ["wsgi.input"].read(65536):
            got.append(chunk)
        return [b""]

    environ = {"wsgi.input": stream}
    if length is not None:
        environ["CONTENT_LENGTH"] = length
    GuardedBodies(app, 5)(environ, lambda *a: None)
    return b"".join(got), stream.reads


def test_a_body_with_a_length_is_not_asked_past_its_end():
    assert _read_all("17") == (b'{"model": "echo"}', 1)


def test_a_body_without_a_length_is_read_to_its_end():
    assert _read_all(None) == (b'{"model": "echo"}', 2)
    assert _read_all("") == (b'{"model": "echo"}', 2)
