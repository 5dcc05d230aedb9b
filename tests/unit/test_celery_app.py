"""The Celery app as make_celery configures it, without a broker."""
from __future__ import annotations

import ssl

from config import load_settings
from tasks.celery_app import make_celery


def test_a_rediss_url_gives_every_client_its_tls_options():
    url = ("rediss://:pw@redis.example.com:6380/0"
           "?ssl_cert_reqs=required&ssl_ca_certs=/etc/ssl/private-ca.pem")
    app = make_celery(load_settings({"redis_url": url}, environ={}))
    expected = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": "/etc/ssl/private-ca.pem"}
    assert app.conf.broker_use_ssl == expected  # what Flower's Broker tab connects with
    assert app.connection_for_write().ssl == expected  # the broker (kombu)
    backend = app.backend.connparams  # the result backend
    assert {k: backend[k] for k in expected} == expected
    assert not make_celery(load_settings({"redis_url": "redis://:pw@h:1/0"},
                                         environ={})).conf.broker_use_ssl
