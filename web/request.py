"""How the API's gunicorn worker reads an HTTP/1 request (web/worker.py makes its parser with
`Parser`): gunicorn's own parser and request classes, a plain request head read in one match
and a body the app read to its end not read again, to the same result as gunicorn's."""
from __future__ import annotations

import re

from gunicorn.config import Config
from gunicorn.http import message
from gunicorn.http.body import LengthReader
from gunicorn.http.parser import RequestParser

# RFC 9110's token (a header's name, message.TOKEN_RE) and the characters a value may hold
# (all but those message.RFC9110_5_5_INVALID_AND_DANGEROUS refuses; HTAB among them), as
# gunicorn's parser checks them; a head is its lines, `name:value`, joined by CRLF.
NAME = r"[!#$%&'*+\-.^_`|~0-9a-zA-Z]+"
_VALUE = r"[^\x00-\x08\x0a-\x1f\x7f]*"
_PLAIN_HEAD = re.compile(rf"{NAME}:{_VALUE}(?:\r\n{NAME}:{_VALUE})*")
_FIELD = re.compile(rf"({NAME}):({_VALUE})")
# Fields the header policy (message.HeaderPolicy) does more with than keep: a second Host or
# Content-Type is refused, an Expect answered.
_WATCHED = frozenset(("HOST", "CONTENT-TYPE", "EXPECT"))


class Request(message.Request):
    """gunicorn's HTTP/1 request, its head read in fewer steps where it is plain, to the same
    result. gunicorn's `parse_headers` takes each line in turn: decoded, split, its name
    matched, upper-cased, its value stripped and searched, and the header policy applied, ~13
    calls a field. A head of plain fields (each `name:value` of RFC 9110's characters, no
    folded line, none longer than `limit_request_field_size`, no more of them than
    `limit_request_fields`, none that the policy does more than keep: Host or Content-Type
    once, no Expect, no scheme header, no name with "_") is decoded once and matched whole;
    any other, and a trailer, goes through gunicorn's, which answers or refuses it as before.
    Whether a peer may send forwarding headers (`forwarded_allow_ips`, fixed for the
    process's life) is worked out once a peer address, not at each request."""

    _trusted: dict[tuple[Config, str], bool] = {}  # (the settings, a peer's address)
    KNOWN_PEERS = 4096

    def parse_headers(self, data, from_trailer=False):
        cfg = self.cfg
        if from_trailer or cfg.strip_header_spaces:
            return super().parse_headers(data, from_trailer)
        text = data.decode("latin-1")
        fields = _FIELD.findall(text) if _PLAIN_HEAD.fullmatch(text) else None
        if fields is None or len(fields) > self.limit_request_fields or \
                len(text) + 2 > self.limit_request_field_size:
            return super().parse_headers(data, from_trailer)
        secure, _forwarders = self._peer_trusted_for_forwarded()
        headers, watched = [], ()
        for name, value in fields:
            name = name.upper()
            if name in _WATCHED:
                if name == "EXPECT" or name in watched:
                    return super().parse_headers(data, from_trailer)
                watched += (name,)
            if "_" in name or name in secure:
                return super().parse_headers(data, from_trailer)
            headers.append((name, value.strip(" \t")))
        return headers

    def _peer_is_trusted_proxy(self):
        peer = self.peer_addr
        if not isinstance(peer, tuple):
            return True
        known = (self.cfg, peer[0])
        trusted = self._trusted.get(known)
        if trusted is None:
            trusted = super()._peer_is_trusted_proxy()
            if len(self._trusted) < self.KNOWN_PEERS:
                self._trusted[known] = trusted
        return trusted


class Parser(RequestParser):
    """gunicorn's HTTP/1 parser, its requests made by `Request`. Before it reads the next
    request, gunicorn discards what the app left of the last one's body (`finish_body`):
    it saves the socket's timeout, reads the body once more, 1 KiB asked through its
    Body, its reader and the unreader (~25 calls), and sets the timeout back. A body of
    known length the app read to its end (every API request's: a GET's is of length 0)
    has nothing left to discard: that is known from the Body, and the same answer given
    at once."""

    mesg_class = Request

    def finish_body(self, deadline=None, max_bytes=None):
        body = getattr(self.mesg, "body", None)
        if body is not None and type(body.reader) is LengthReader and \
                body.reader.length == 0 and body.failed is False and not body.buf.tell():
            return True
        return super().finish_body(deadline, max_bytes)
