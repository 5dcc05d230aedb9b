"""REDIS_URL on a Unix socket (redis-py's `unix://` spelling): what kombu, Celery's backend,
the worker's transport and the project's own clients are given for it, and the settings'
one-line errors for a bad one. The stack on a socket: tests/integration/test_unix_socket.py."""
from __future__ import annotations

import pytest
import redis
from redis.connection import UnixDomainSocketConnection

from config import load_settings
from config.checks import ConfigError
from tasks.celery_app import make_celery, socket_url
from tasks.redis_client import DEADLINE_CONNECTIONS, connect
from tasks.results import ResultBackend
from workers.broker import transport

URL = "unix://iq:p%40ss@/run/iq/redis.sock?db=2"


def test_kombu_and_celery_get_the_socket_in_their_spelling():
    assert socket_url(URL) == "redis+socket://iq:p%40ss@/run/iq/redis.sock?virtual_host=2"
    assert socket_url("unix:///run/r.sock") == "redis+socket:///run/r.sock?virtual_host=0"
    assert socket_url("redis://h:1/0") == "redis://h:1/0"
    app = make_celery(load_settings({"redis_url": URL}, environ={}))
    assert app.conf.broker_url == "redis+socket://iq:p%40ss@/run/iq/redis.sock?virtual_host=2"
    conn = app.connection_for_write()
    assert conn.transport_cls == "redis" and conn.hostname.startswith("socket://")
    assert type(app.backend) is ResultBackend
    params = app.backend.connparams
    assert params["connection_class"] is UnixDomainSocketConnection
    assert (params["path"], params["db"], params["username"], params["password"]) == \
        ("/run/iq/redis.sock", 2, "iq", "p@ss")


def test_the_worker_fetches_from_the_socket_through_its_own_transport():
    app = make_celery(load_settings({"redis_url": URL}, environ={}))
    assert transport.alias_for(app.conf.broker_url) == transport.REDIS_ALIAS
    transport.select(app)
    assert app.conf.broker_url == "iqredis+socket://iq:p%40ss@/run/iq/redis.sock?virtual_host=2"
    conn = app.connection_for_read()
    assert isinstance(conn.transport, transport.Transport)
    assert conn.hostname == "socket://iq:p%40ss@/run/iq/redis.sock?virtual_host=2"
    # kombu's failover keeps the worker's transport (and the socket) on a switch
    urls = transport.keep_the_transport([app.conf.broker_url])
    assert next(urls) == app.conf.broker_url


def test_the_projects_own_clients_connect_to_the_socket_with_their_deadlines():
    settings = load_settings({"redis_url": URL}, environ={})
    api = connect(URL, settings, max_connections=4, deadline_s=1.0)
    kwargs = api.connection_pool.connection_kwargs
    assert api.connection_pool.connection_class is \
        DEADLINE_CONNECTIONS[UnixDomainSocketConnection]
    assert (kwargs["path"], kwargs["db"]) == ("/run/iq/redis.sock", 2)
    worker = connect(URL, settings)
    assert worker.connection_pool.connection_class is UnixDomainSocketConnection
    with pytest.raises(redis.ConnectionError):  # no such socket: a connection error, retried
        worker.ping()


@pytest.mark.parametrize("url", [
    "unix://run/iq/redis.sock",  # a relative path (its first part read as a host)
    "unix:///run/iq/redis.sock?db=two", "unix:///run/iq/redis.sock?timeout=1",
    "unix:///", "unix://", "unix:///" + "a" * 107])
def test_a_bad_socket_url_is_one_line_naming_redis_url_and_the_value(url):
    with pytest.raises(ConfigError) as caught:
        load_settings({"redis_url": url}, environ={})
    assert str(caught.value).startswith("redis_url must be unix:///absolute/path")
    assert repr(url) in str(caught.value) and "\n" not in str(caught.value)


def test_a_bad_socket_url_hides_its_password_and_a_group_is_checked_the_same():
    with pytest.raises(ConfigError) as caught:
        load_settings({"redis_url": "unix://iq:secret@/x?db=a"}, environ={})
    assert "'unix://iq:**@/x?db=a'" in str(caught.value) and "secret" not in str(caught.value)
    with pytest.raises(ConfigError, match=r"^redis_groups.b must be unix:///"):
        load_settings({"redis_groups": "b=unix://sock"}, environ={})
    with pytest.raises(ConfigError, match="with redis_sentinels"):
        load_settings({"redis_url": URL, "redis_sentinels": "s1:26379", "redis_master": "m"},
                      environ={})
    load_settings({"redis_url": "unix:///" + "a" * 106}, environ={})  # 107 bytes: fits


def test_the_settings_show_a_socket_url_without_its_password():
    shown = repr(load_settings({"redis_url": "unix://iq:hunter2@/run/r.sock?db=2"}, environ={}))
    assert "redis_url='unix://iq:**@/run/r.sock?db=2'" in shown and "hunter2" not in shown
