"""The API's Redis connections check, as the pool hands them out, for anything left to read
without a turn of gevent's event loop (tasks/redis_client.py IdleCheck), and a connection
with something left on it is still replaced as redis-py replaces it."""
from __future__ import annotations

import json
import select
import socket
import subprocess
import sys

import pytest

from config import load_settings
from scripts.processes import wait_until
from tasks import redis_client

PROBE = """
from gevent import monkey
monkey.patch_all()
import json, sys
import greenlet
from config import load_settings
from tasks import redis_client, redis_deadline

client = redis_client.connect(sys.argv[1], load_settings(), max_connections=4, deadline_s=2.0)
with redis_deadline.deadline(2.0):
    client.set("idle-check", "v")  # the pool's connection made
    events, polls = [], []
    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.endswith("gevent/select.py"):
            polls.append(code.co_name)
    greenlet.settrace(lambda event, args: events.append(event))
    sys.setprofile(profile)
    value = client.get("idle-check")
    sys.setprofile(None)
    greenlet.settrace(None)
print(json.dumps([value, polls, events]))
"""


def test_a_pooled_connection_is_checked_without_a_turn_of_geventss_loop(redis_server):
    """Under gevent's patching, a command on a pooled connection parks its greenlet only to
    wait for its reply: redis-py's check of the connection (gevent's poll, a zero-second
    timer thrown at the greenlet on the next loop turn) is not made."""
    out = subprocess.run([sys.executable, "-c", PROBE, redis_server.extra["url"]],
                         capture_output=True, text=True, timeout=60, check=True)
    value, polls, events = json.loads(out.stdout.strip().splitlines()[-1])
    assert value == "v"
    assert polls == [] and "throw" not in events, (polls, events)


def _connection(redis_server):
    client = redis_client.connect(redis_server.extra["url"], load_settings(),
                                  max_connections=2, deadline_s=2.0)
    pool = client.connection_pool
    connection = pool.get_connection()
    connection.send_command("PING")
    assert connection.read_response() == "PONG"
    return client, connection


def _settled(connection, size: int) -> None:
    """Until `size` bytes wait on the connection's socket."""
    sock = connection._sock
    wait_until(lambda: select.select([sock], [], [], 0)[0] and
               len(sock.recv(64, socket.MSG_PEEK)) >= size, 5, f"{size} bytes to read")


PING, PONG = b"*1\r\n$4\r\nPING\r\n", b"+PONG\r\n"


def _left_on_socket(connection, admin) -> None:
    connection.send_packed_command([PING])  # its reply never read
    _settled(connection, len(PONG))


def _left_in_buffer(connection, admin) -> None:
    """Two replies, one read: the other in hiredis's buffer, nothing on the socket."""
    connection.send_packed_command([PING + PING])
    _settled(connection, 2 * len(PONG))
    assert connection.read_response() == "PONG"
    assert not select.select([connection._sock], [], [], 0)[0]


def _closed_by_the_server(connection, admin) -> None:
    assert admin.client_kill(f"127.0.0.1:{connection._sock.getsockname()[1]}")
    sock = connection._sock
    wait_until(lambda: select.select([sock], [], [], 0)[0], 5, "the close seen")


def _idle(connection, admin) -> None:
    pass


@pytest.mark.parametrize("state", [_idle, _left_on_socket, _left_in_buffer,
                                   _closed_by_the_server])
def test_the_check_answers_as_redis_pys_own(redis_server, state):
    """What a connection's check says (nothing to read; a reply on its socket or in its
    parser's buffer; closed by the server, a ConnectionError) is what redis-py's own
    `Connection.can_read` says of a connection in the same state."""
    import redis

    admin = redis.Redis.from_url(redis_server.extra["admin_url"])
    answers = []
    for check in (lambda c: c.can_read(), lambda c: redis.Connection.can_read(c)):
        client, connection = _connection(redis_server)
        state(connection, admin)
        try:
            answers.append(check(connection))
        except redis.ConnectionError as exc:
            answers.append(type(exc))
        client.close()
    assert answers[0] == answers[1]
    assert answers[0] == {_idle: False, _closed_by_the_server: redis.ConnectionError}.get(
        state, True)
