"""Two answers' headers that were not the same from one API process to the next, or named a
parameter twice (found by session 7's outside attack, comparing two releases byte for byte):
a 405's Allow lists its methods sorted; /metrics names its charset once."""
from __future__ import annotations

import subprocess
import sys


from scripts.processes import ROOT

_ALLOW = """
from flask import Flask
from app.errors import register_error_handlers
from app.json_provider import OrjsonProvider
Flask.json_provider_class = OrjsonProvider
app = Flask("t")
register_error_handlers(app)
app.add_url_rule("/healthz", "h", lambda: "ok")
print(app.test_client().delete("/healthz").headers["Allow"])
"""


def allow_header(seed: str) -> str:
    return subprocess.run([sys.executable, "-c", _ALLOW], cwd=ROOT, check=True, text=True,
                          capture_output=True,
                          env={"PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}).stdout.strip()


def test_a_405s_allow_header_is_the_same_in_every_api_process():
    """A 405's Allow header listed the methods in the order of a Python set, which differs
    from one API process to the next (string hashes are salted per process): the same
    request answered `Allow: GET, HEAD, OPTIONS` by one process, `HEAD, OPTIONS, GET` by
    another. It is sorted."""
    assert allow_header("0") == "GET, HEAD, OPTIONS"
    assert allow_header("0") == allow_header("4")


_SCRAPE = """
from app.metrics import ApiMetrics
print(ApiMetrics(lambda: {}, lambda: 0, 5, lambda: (0, 0)).render().headers["Content-Type"])
"""


def test_metrics_names_its_charset_once(tmp_path):
    """/metrics answered `Content-Type: text/plain; version=1.0.0; charset=utf-8;
    charset=utf-8`: a parameter twice, which a strict scraper may refuse or read either
    way."""
    content_type = subprocess.run([sys.executable, "-c", _SCRAPE], cwd=ROOT, check=True,
                                  capture_output=True, text=True,
                                  env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
                                       "PYTHONPATH": str(ROOT)}).stdout.strip()
    assert content_type.count("charset=") == 1, content_type
