"""tasks.egress against real listeners on loopback, with the resolver replaced in-process
where a test needs DNS to say something it would not."""
from __future__ import annotations

import socket
import ssl
import time

import pytest
import trustme

from tasks import egress
from tests.support.receivers import Receiver, Tarpit


class Resolver:
    """getaddrinfo that answers `answers` in turn (the last one for good) and counts calls."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.calls = 0

    def __call__(self, host, port, *args, **kwargs):
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (answer, int(port)))]


def receivers_on_one_port() -> tuple[Receiver, Receiver]:
    """A receiver on 127.0.0.2 and another on 127.0.0.1, on the same port."""
    for _ in range(20):
        outer = Receiver(host="127.0.0.2")
        try:
            return outer, Receiver(host="127.0.0.1", port=outer.port)
        except OSError:
            outer.close()
    raise RuntimeError("no port free on both 127.0.0.1 and 127.0.0.2")


@pytest.mark.parametrize("url", [
    "http://localhost/", "http://127.0.0.1/", "http://10.0.0.8/", "http://[::1]/",
    "http://[::ffff:127.0.0.1]/", "http://169.254.169.254/", "http://0.0.0.0/",
    "http://no-such-host.invalid/",
])
def test_refusals_name_the_rule_not_the_address(url):
    with pytest.raises(egress.Refused) as refused:
        egress.check_url(url)
    message = str(refused.value)
    assert message == egress.NOT_PUBLIC
    for address in ("127.", "::1", "10.0.0.8", "169.254", "0.0.0.0"):
        assert address not in message


# Each form the security review got through (the first four), and the rest of each family.
NOT_PUBLIC_FORMS = [
    "::127.0.0.1",              # IPv4-compatible loopback
    "::ffff:0:127.0.0.1",       # IPv4-translated loopback
    "64:ff9b:1::808:808",       # local-use NAT64 (RFC 8215), whatever it carries
    "192.0.0.8",                # IPv4 dummy address, in the IETF protocol block
    "::a00:1", "::ffff:10.0.0.1", "::ffff:0:169.254.169.254",
    "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe",         # NAT64 of loopback, metadata
    "2002:7f00:1::1", "2002:c0a8:101::1",             # 6to4 of loopback, 192.168.1.1
    "2001:0:4136:e378:8000:63bf:3fff:fdd2",           # Teredo
    "2001:db8::1", "3fff::1", "100::1", "5f00::1", "fec0::1", "fc00::1", "fe80::1",
    "ff02::1", "::", "192.0.0.170", "192.0.2.1", "192.88.99.1", "198.18.0.1",
    "198.51.100.1", "203.0.113.1", "100.64.0.1", "240.0.0.1", "255.255.255.255",
    "224.0.0.1", "0.1.2.3",
]


@pytest.mark.parametrize("address", NOT_PUBLIC_FORMS)
def test_every_non_public_form_is_refused(address):
    host = f"[{address}]" if ":" in address else address
    with pytest.raises(egress.Refused, match="only to public addresses"):
        egress.check_url(f"http://{host}/hook")


@pytest.mark.parametrize("address", [
    "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808", "2002:808:808::1",
])
def test_public_addresses_and_their_ipv6_forms_pass(address):
    host = f"[{address}]" if ":" in address else address
    assert egress.check_url(f"http://{host}/hook").addresses


def test_an_allow_list_cidr_admits_a_special_address():
    assert egress.check_url("http://192.0.0.8/hook", allow=["192.0.0.0/24"]).addresses


@pytest.mark.parametrize("url, rule", [
    ("http://example.com:99999/", "ports are 1 to 65535"),
    ("ftp://example.com/", "http:// or https://"),
    ("http://user:pw@example.com/", "credentials"),
    ("http://[::1/", "not a valid URL"),
    ("http://[]/", "not a valid URL"),
    ("http://[zz]/", "not a valid URL"),
    ("http://[::1%25%00]/", "not a valid URL"),
])
def test_malformed_urls_are_refused_not_crashed_on(url, rule):
    with pytest.raises(egress.Refused, match=rule):
        egress.check_url(url)


def test_a_rebinding_resolver_gets_the_checked_address_not_the_second_answer(monkeypatch):
    checked, inner = receivers_on_one_port()
    resolver = Resolver("127.0.0.2", "127.0.0.1")  # allowed at check time, inward after
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    try:
        url = f"http://rebind.test:{checked.port}/internal-admin"
        answer = egress.fetch(url, allow=["127.0.0.2"], method="POST", body=b"{}",
                              deadline_s=10, max_bytes=1024)
        assert answer.status == 204 and resolver.calls == 1
        assert [c["path"] for c in checked.calls] == ["/internal-admin"]
        assert checked.calls[0]["headers"]["host"] == f"rebind.test:{checked.port}"
        assert inner.calls == []
    finally:
        checked.close()
        inner.close()


def test_a_public_first_answer_is_where_the_connection_goes(monkeypatch):
    inner = Receiver(host="127.0.0.1")
    resolver = Resolver("93.184.215.14", "127.0.0.1")
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    dialled: list[tuple] = []

    def connect(sock, address):  # no route to the Internet here: record, and refuse
        dialled.append(address)
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(egress._DeadlineSocket, "connect", connect)
    try:
        with pytest.raises(egress.RequestFailed, match="could not connect|connection failed"):
            egress.fetch(f"http://rebind.test:{inner.port}/internal-admin", method="POST",
                         deadline_s=10, max_bytes=1024)
        assert dialled == [("93.184.215.14", inner.port)] and resolver.calls == 1
        assert inner.calls == []
    finally:
        inner.close()


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


def tls_receiver(ca, name: str) -> Receiver:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(name).configure_cert(context)
    return Receiver(tls=context)


def test_tls_goes_to_the_checked_address_under_the_original_name(ca, tmp_path, monkeypatch):
    cafile = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(cafile))
    monkeypatch.setattr(socket, "getaddrinfo", Resolver("127.0.0.1"))
    good, wrong = tls_receiver(ca, "hooks.test"), tls_receiver(ca, "other.test")
    try:
        answer = egress.fetch(f"https://hooks.test:{good.port}/hook", allow=["127.0.0.1"],
                              deadline_s=10, max_bytes=1024, cafile=str(cafile))
        assert answer.status == 204
        assert good.server_names == ["hooks.test"]
        assert good.calls[0]["headers"]["host"] == f"hooks.test:{good.port}"
        # The certificate is checked against the name asked for, not the address dialled.
        with pytest.raises(egress.RequestFailed, match="TLS failed"):
            egress.fetch(f"https://hooks.test:{wrong.port}/hook", allow=["127.0.0.1"],
                         deadline_s=10, max_bytes=1024, cafile=str(cafile))
        assert wrong.calls == []
    finally:
        good.close()
        wrong.close()


def test_a_redirect_is_the_answer_not_followed():
    receiver = Receiver(status=302)
    try:
        answer = egress.fetch(receiver.url, allow=["127.0.0.1"], deadline_s=10, max_bytes=1024)
        assert answer.status == 302 and answer.headers["location"].endswith("/elsewhere")
        assert len(receiver.calls) == 1
    finally:
        receiver.close()


def test_a_trickling_answer_cannot_stretch_the_deadline():
    tarpit = Tarpit(interval=0.3)
    try:
        started = time.monotonic()
        with pytest.raises(egress.DeadlineExceeded):
            egress.fetch(tarpit.url, allow=["127.0.0.1"], deadline_s=1.5, max_bytes=1024)
        elapsed = time.monotonic() - started
        # Bytes kept coming, more often than the deadline: a per-read timeout would have
        # waited forever. The bound is generous: it only has to be finite.
        assert tarpit.bytes_sent >= 2
        assert elapsed < 10, elapsed
    finally:
        tarpit.close()


def test_a_body_over_the_cap_is_refused_with_the_status():
    receiver = Receiver(status=200, body=b"x" * 100)
    try:
        assert egress.fetch(receiver.url, allow=["127.0.0.1"], deadline_s=10,
                            max_bytes=100).body == b"x" * 100
        with pytest.raises(egress.TooLarge) as too_large:
            egress.fetch(receiver.url, allow=["127.0.0.1"], deadline_s=10, max_bytes=99)
        assert too_large.value.status == 200
    finally:
        receiver.close()
