"""The Celery app as make_celery configures it, without a broker."""
from __future__ import annotations

import ssl

from celery.backends.redis import SentinelBackend

from config import load_settings
from tasks.celery_app import make_celery
from tasks.results import ResultBackend, SentinelResultBackend


def test_a_rediss_url_gives_every_client_its_tls_options():
    url = ("rediss://:pw@redis.example.com:6380/0"
           "?ssl_cert_reqs=required&ssl_ca_certs=/etc/ssl/private-ca.pem")
    app = make_celery(load_settings({"redis_url": url}, environ={}))
    expected = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": "/etc/ssl/private-ca.pem"}
    assert app.conf.broker_use_ssl == expected  # what Flower's Broker tab connects with
    assert app.connection_for_write().ssl == expected  # the broker (kombu)
    assert type(app.backend) is ResultBackend  # the result backend
    backend = app.backend.connparams
    assert {k: backend[k] for k in expected} == expected
    assert not make_celery(load_settings({"redis_url": "redis://:pw@h:1/0"},
                                         environ={})).conf.broker_use_ssl


def test_with_sentinels_broker_and_backend_ask_them_for_the_primary():
    settings = load_settings({"redis_url": "redis://iq:p%40ss@primary.local:6379/2",
                              "redis_sentinels": "s1:26379,[fd00::2]:26380",
                              "redis_master": "jobs", "redis_sentinel_user": "iq",
                              "redis_sentinel_password": "sentinel-pw"}, environ={})
    app = make_celery(settings)
    urls = "sentinel://iq:p%40ss@s1:26379/2;sentinel://iq:p%40ss@[fd00::2]:26380/2"
    assert app.conf.broker_url == urls
    # Celery's Sentinel backend, as tasks/results.py extends it for packed results
    assert app.conf.result_backend == f"tasks.results:SentinelResultBackend+{urls}"
    for options in (app.conf.broker_transport_options,
                    app.conf.result_backend_transport_options):
        assert options["master_name"] == "jobs"
        assert {k: options["sentinel_kwargs"][k] for k in ("username", "password")} == \
            {"username": "iq", "password": "sentinel-pw"}
    connection = app.connection_for_write()  # kombu's Sentinel transport, every sentinel
    assert connection.transport_cls == "sentinel" and len(connection.alt) == 2
    assert (connection.userid, connection.password) == ("iq", "p@ss")
    backend = app.backend  # Celery's Sentinel backend: each sentinel, the primary's login
    assert isinstance(backend, SentinelBackend) and isinstance(backend, SentinelResultBackend)
    assert [(h["host"], h["port"]) for h in backend.connparams["hosts"]] == \
        [("s1", 26379), ("fd00::2", 26380)]
    assert (backend.connparams["username"], backend.connparams["password"], \
            backend.connparams["db"]) == ("iq", "p@ss", 2)
