"""The test stack's ports (scripts/processes.py): chosen where no outgoing connection can take
one before its server binds it, and a server that exits instead of starting is reported at once
with its log, not after its wait runs out."""
import socket
import time

import pytest

from scripts.processes import Exited, _ephemeral_ports, free_port
from scripts.redis_nodes import start_redis, start_sentinel


def test_a_free_port_is_never_one_the_kernel_gives_outgoing_connections():
    ephemeral = _ephemeral_ports()
    handed = [free_port() for _ in range(500)]
    ports = set(handed)
    assert len(ports) == len(handed)  # never the same twice: several are set up before any binds
    assert not ports & set(ephemeral)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nothing listens there


def test_a_sentinel_whose_port_is_taken_fails_at_once_with_its_log(tmp_path):
    primary = start_redis(tmp_path)
    try:
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", 0))
            squatter.listen()
            port = squatter.getsockname()[1]
            started = time.monotonic()
            with pytest.raises(Exited, match=r"(?s)sentinel on %d: exited.*in use" % port):
                start_sentinel(tmp_path, primary, port=port)
            assert time.monotonic() - started < 15  # its wait is 20 s
    finally:
        primary.stop()
