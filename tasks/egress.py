"""Outbound HTTP that cannot be turned inward: every request the service makes to a URL a
client gave it (webhooks, image URLs) goes through `fetch`.

- The host is resolved once, and every address it resolves to is checked: anything but public
  unicast (private, loopback, link-local, multicast, reserved and the other special-purpose
  blocks, IPv4 inside IPv6 unwrapped first: tasks/addresses.py) is refused unless the host, or
  a CIDR holding the address, is in the caller's allow list.
- The connection goes to an address that was checked, never to a second resolution (DNS
  rebinding), with the original name in the Host header and, for https, as the TLS server
  name that the certificate is verified against.
- Redirects are not followed: a 3xx is the answer.
- One deadline bounds the whole request (connect, TLS, sending, headers and body), however
  slowly the other side trickles bytes; the body read is capped.
- Refusals name the rule broken, never what a name resolved to, so that the service is not
  an oracle for internal DNS.
"""
from __future__ import annotations

import functools
import http.client
import ipaddress
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence
from urllib.parse import urlsplit

from tasks.addresses import is_public

NOT_PUBLIC = ("the host must resolve, and only to public addresses "
              "(not private, loopback, link-local, multicast or reserved ones)")


class EgressError(Exception):
    """The request was not made, or not completed; the message says why."""


class Refused(EgressError, ValueError):
    """The URL may not be called (a client's mistake or a policy): the message names the rule."""


class NotPublic(Refused):
    """The URL's host is not public and not in the allow list: the caller names its setting."""

    def __init__(self) -> None:
        super().__init__(NOT_PUBLIC)


class RequestFailed(EgressError):
    """The request was allowed but did not complete: connection, TLS, protocol or deadline."""


class DeadlineExceeded(RequestFailed):
    pass


class TooLarge(RequestFailed):
    """The answer's body is larger than `max_bytes`; `status` is the answer's status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Target:
    """A checked URL: where to connect (`addresses`, as getaddrinfo gives them) and what to
    ask for. `host` is the original name (IDNA-encoded), for Host and TLS."""
    scheme: str
    host: str
    port: int
    path: str
    addresses: tuple[tuple[int, tuple[Any, ...]], ...] = field(repr=False)


@dataclass(frozen=True)
class Response:
    status: int
    headers: Mapping[str, str]  # names lower-cased; repeated headers joined with ", "
    body: bytes


def _allowed(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, allow: Sequence[str]) -> bool:
    for entry in allow:
        try:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:  # a host name, not a CIDR
            continue
    return False


def check_url(url: str, *, allow: Sequence[str] = ()) -> Target:
    """Parse `url`, resolve its host once and check every address; raise Refused unless it
    is http(s) to public addresses, or to a host or CIDR in `allow`."""
    try:
        parts = urlsplit(url)
    except ValueError:  # brackets unbalanced or around no IP address: http://[::1/, http://[]/
        raise Refused("is not a valid URL (a bracketed host must be an IPv6 address)") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Refused("must be an http:// or https:// URL with a host")
    if parts.username is not None or parts.password is not None:
        raise Refused("must not carry credentials")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = parts.hostname.encode("idna").decode("ascii")
    except ValueError:  # a port out of range, or a host IDNA cannot encode (UnicodeError)
        raise Refused("the host or port is not valid (ports are 1 to 65535)") from None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        raise NotPublic() from None
    addresses = tuple(dict.fromkeys((family, sockaddr) for family, _, _, _, sockaddr in infos))
    if host not in allow:
        for _family, sockaddr in addresses:
            ip = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
            if not is_public(ip) and not _allowed(ip, allow):
                raise NotPublic()
    path = parts.path or "/"
    return Target(parts.scheme, host, port, f"{path}?{parts.query}" if parts.query else path,
                  addresses)


class _Deadline:
    """A socket whose every blocking call gets the time left until `deadline` as its
    timeout, so that a peer sending a byte every few seconds cannot stretch a request (a
    plain socket timeout bounds each call, not their sum). CPython's TLS reads and writes
    honour one timeout across their internal retries."""

    deadline: float

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        self.settimeout(left)  # type: ignore[attr-defined]

    def recv_into(self, *args: Any, **kwargs: Any) -> int:
        self._arm()
        return super().recv_into(*args, **kwargs)  # type: ignore[misc]

    def send(self, *args: Any, **kwargs: Any) -> int:
        self._arm()
        return super().send(*args, **kwargs)  # type: ignore[misc]

    def sendall(self, *args: Any, **kwargs: Any) -> None:
        self._arm()
        return super().sendall(*args, **kwargs)  # type: ignore[misc]


class _DeadlineSocket(_Deadline, socket.socket):
    pass


class _DeadlineSSLSocket(_Deadline, ssl.SSLSocket):
    pass


@functools.lru_cache(maxsize=8)
def _tls_context(cafile: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=cafile)
    context.sslsocket_class = _DeadlineSSLSocket
    return context


class _PinnedConnection(http.client.HTTPConnection):
    """One request to one checked address; the Host header comes from the original name."""

    def __init__(self, target: Target, address: tuple[int, tuple[Any, ...]], deadline: float,
                 tls: ssl.SSLContext | None) -> None:
        super().__init__(target.host, target.port)
        if tls is not None:
            self.default_port = 443  # for the Host header, which omits the default port
        self._address, self._deadline, self._tls = address, deadline, tls

    def connect(self) -> None:
        family, sockaddr = self._address
        sock: _Deadline = _DeadlineSocket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.deadline = self._deadline
        try:
            sock._arm()
            sock.connect(sockaddr)  # type: ignore[attr-defined]
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # type: ignore[attr-defined]
            if self._tls is not None:
                sock._arm()  # the handshake runs under the raw socket's timeout
                sock = self._tls.wrap_socket(sock, server_hostname=self.host)  # type: ignore
                sock.deadline = self._deadline
        except BaseException:
            sock.close()  # type: ignore[attr-defined]
            raise
        self.sock = sock


def fetch(url: str, *, allow: Sequence[str] = (), method: str = "GET",
          body: bytes | None = None, headers: Mapping[str, str] | None = None,
          deadline_s: float, max_bytes: int, cafile: str | None = None) -> Response:
    """Make one HTTP request to `url` as the module docstring describes, and return the
    answer, whatever its status. `deadline_s` bounds the whole request (a slow DNS answer
    counts against it but cannot be cut short); a body over `max_bytes` raises TooLarge.
    `cafile`: trust these CAs instead of the system's. Raises Refused or RequestFailed."""
    deadline = time.monotonic() + deadline_s
    target = check_url(url, allow=allow)
    tls = _tls_context(cafile) if target.scheme == "https" else None
    try:
        conn = _connect(target, deadline, tls)
        try:
            return _exchange(conn, target, method, body, headers or {}, max_bytes)
        finally:
            conn.close()
    except TimeoutError:
        raise DeadlineExceeded(f"no complete answer within {deadline_s:g}s") from None
    except ssl.SSLError as exc:
        detail = getattr(exc, "verify_message", None) or exc.reason or exc
        raise RequestFailed(f"TLS failed: {detail}") from None
    except http.client.HTTPException as exc:
        raise RequestFailed(f"not a valid HTTP answer ({type(exc).__name__})") from None
    except OSError as exc:
        raise RequestFailed(f"connection failed: {exc.strerror or exc}") from None


def _connect(target: Target, deadline: float,
             tls: ssl.SSLContext | None) -> _PinnedConnection:
    """A connection to the first checked address that accepts one. Only failures to connect
    move on to the next address: nothing has been sent yet."""
    failure: OSError = OSError("the host has no address")
    for address in target.addresses:
        conn = _PinnedConnection(target, address, deadline, tls)
        try:
            conn.connect()
            return conn
        except (TimeoutError, ssl.SSLError):
            conn.close()
            raise
        except OSError as exc:
            conn.close()
            failure = exc
    raise failure


def _exchange(conn: _PinnedConnection, target: Target, method: str, body: bytes | None,
              headers: Mapping[str, str], max_bytes: int) -> Response:
    conn.request(method, target.path, body=body, headers={**headers, "Connection": "close"})
    answer = conn.getresponse()
    length = answer.getheader("Content-Length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise TooLarge(f"the answer's body is over {max_bytes} bytes", answer.status)
    received = bytearray()
    while len(received) <= max_bytes:
        chunk = answer.read(min(65_536, max_bytes + 1 - len(received)))
        if not chunk:
            break
        received += chunk
    if len(received) > max_bytes:
        raise TooLarge(f"the answer's body is over {max_bytes} bytes", answer.status)
    names: dict[str, str] = {}
    for name, value in answer.getheaders():
        key = name.lower()
        names[key] = f"{names[key]}, {value}" if key in names else value
    return Response(answer.status, names, bytes(received))
