"""The client's pieces that need no server: base64 outputs, error types, Retry-After (parsed,
and the pause it makes between tries), and the package itself (pip installs it, with its
command)."""
from __future__ import annotations

import base64
import shutil
import struct
import subprocess
import sys
import time
from email.utils import formatdate

import numpy as np
import pytest
import requests

import inference_queue_client as iqc
from inference_queue_client import cli
from inference_queue_client import client as client_module
from inference_queue_client.errors import api_error, parse_retry_after
from scripts.stack import ROOT


def b64(*values: float) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


def test_base64_vectors_decode_to_the_float32_values_sent():
    text = b64(1.5, -2.25, 0.1, 3e38)
    expected = np.frombuffer(base64.b64decode(text), dtype="<f4").tolist()
    assert iqc.decode_float32(text) == expected
    assert expected[:2] == [1.5, -2.25]


@pytest.mark.parametrize("text, why", [("not base64!", "not base64"),
                                       (base64.b64encode(b"123456").decode(), "6 bytes")])
def test_bad_base64_outputs_name_the_output(text, why):
    with pytest.raises(iqc.DecodeError, match=f"output 1: .*{why}"):
        iqc.decode_outputs([b64(1.0), text])


def test_job_outputs_are_decoded_when_they_travel_as_base64():
    body = {"id": "j", "status": "succeeded", "result": {"outputs": [b64(1, 2), b64(3, 4)]}}
    asked = iqc.Job(body, encoding_format="base64")
    said = iqc.Job({**body, "encoding_format": "base64"})  # the API's word for it
    for job in (asked, said):
        assert job.outputs == [[1.0, 2.0], [3.0, 4.0]]
        assert job.array().tolist() == [[1.0, 2.0], [3.0, 4.0]]
        assert job.as_dict()["result"]["outputs"] == [[1.0, 2.0], [3.0, 4.0]]
    # JSON outputs are left alone, labels and all.
    labels = [{"label": "a", "scores": {"a": 0.9}}]
    assert iqc.Job({"id": "j", "status": "succeeded", "result": {"outputs": labels}}).outputs \
        == labels


def test_a_job_that_did_not_succeed_raises_its_error_for_outputs():
    job = iqc.Job({"id": "j", "status": "failed",
                   "error": {"code": "inference_error", "message": "boom"}})
    with pytest.raises(iqc.JobFailed, match="inference_error: boom") as failed:
        job.result()
    assert failed.value.code == "inference_error" and failed.value.job is job


def _api_error_classes(cls: type) -> list[type]:
    return [cls] + [d for sub in cls.__subclasses__() for d in _api_error_classes(sub)]


def test_every_error_code_of_the_api_has_its_client_type():
    import app.auth  # noqa: F401 - defines the access errors
    from app.errors import APIError

    for server in _api_error_classes(APIError)[1:]:
        client = api_error(server.status, {"error": {"code": server.code, "message": "m"}})
        assert client.code == server.code and client.http_status == server.status
        assert type(client) is not iqc.APIError, f"{server.code} has no client type"


def test_errors_without_an_error_object_are_typed_by_status():
    proxy_page = api_error(503, "<html>Service Unavailable</html>", "7")
    assert isinstance(proxy_page, iqc.Unavailable) and proxy_page.retry_after == 7
    assert proxy_page.code == "http_503"
    assert type(api_error(502, "bad gateway")) is iqc.APIError


def test_retry_after_as_seconds_or_a_date():
    assert parse_retry_after("5") == 5
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    in_a_minute = parse_retry_after(formatdate(time.time() + 60, usegmt=True))
    assert 50 < in_a_minute <= 60


def test_pip_installs_the_package_and_its_command(tmp_path):
    # From a copy: setuptools builds in the source folder, which is left as it was.
    source = shutil.copytree(ROOT / "client", tmp_path / "client",
                             ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(source)],
                   check=True, timeout=120)
    script = target / "bin" / "iq-client"
    assert script.exists()
    # The installed copy, not the checkout's: run from elsewhere with only the target added.
    shown = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                           text=True, cwd=tmp_path, env={"PYTHONPATH": str(target)}, timeout=30)
    assert shown.returncode == 0 and "submit" in shown.stdout, shown.stderr


def test_pip_install_from_the_checkout_leaves_it_clean(tmp_path):
    """`pip install ./client` builds in the source folder (build/, *.egg-info): git ignores
    what it leaves there."""
    had_build = (ROOT / "client" / "build").exists()
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--no-build-isolation", "--target", str(tmp_path / "site"),
                        str(ROOT / "client")], check=True, timeout=120)
        assert (ROOT / "client" / "build").is_dir()  # what the issue saw left untracked
        left = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--",
                               "client"], cwd=ROOT, capture_output=True, text=True, check=True)
        assert left.stdout == ""
    finally:
        if not had_build:
            shutil.rmtree(ROOT / "client" / "build", ignore_errors=True)


def test_a_body_json_cannot_carry_is_refused_before_anything_is_sent():
    # No server at this address: a request sent would fail as ConnectionFailed instead.
    client = iqc.Client("http://127.0.0.1:9", retry_for=0)
    for inputs in ([[1.0, float("nan")]], [[float("inf")]], [{1, 2}]):
        with pytest.raises(iqc.InvalidRequest, match="cannot be sent as JSON") as refused:
            client.submit("ts-affine", inputs)
        assert isinstance(refused.value, iqc.IQError)


def test_array_without_numpy_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "numpy", None)  # `import numpy` fails as if absent
    job = iqc.Job({"id": "j", "status": "succeeded", "result": {"outputs": [[1.0]]}})
    with pytest.raises(iqc.MissingDependency, match=r"inference-queue-client\[numpy\]"):
        job.array()
    assert job.outputs == [[1.0]]  # everything else works without it


@pytest.mark.parametrize("args, stdin, said", [
    (["submit", "m"], "", "no inputs"),
    (["submit", "m", "--json"], '"ok"\nnot json\n', "inputs line 2 is not JSON"),
    (["submit", "m", "/no/such/file"], "", "cannot read the inputs"),
    (["submit", "m", "--per-job", "1", "--idempotency-key", "k"], "a\nb\n", "names one job"),
    (["wait"], "{}\n", "not a job id"),
])
def test_cli_usage_errors_exit_2_before_any_request(args, stdin, said, monkeypatch, capsys):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    # No server at this address: a request would fail differently (and slowly).
    assert cli.main(["--url", "http://127.0.0.1:9", "--retry-for", "0", *args]) == 2
    assert said in capsys.readouterr().err


class Clock:
    """The client's `time` on a clock of the test's own: sleeping and each answer's wait
    advance it, so the pauses between tries are counted, not waited."""

    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 3))
        self.now += seconds


class Answers:
    """A session answering from a script: (seconds the answer takes, status, Retry-After)."""

    def __init__(self, clock: Clock, script: list[tuple[float, int, str | None]]) -> None:
        self.clock, self.script, self.headers, self.sent = clock, list(script), {}, []

    def request(self, method, url, headers=None, **kw):
        took, status, retry_after = self.script.pop(0)
        self.clock.now += took
        self.sent.append((self.clock.now - took, headers.get("Idempotency-Key")))
        response = requests.Response()
        response.status_code = status
        response._content = (b'{"id": "job-1", "status": "queued"}' if status == 202 else
                             b'{"error": {"code": "unavailable", "message": "m"}}')
        if retry_after is not None:
            response.headers["Retry-After"] = retry_after
        return response


@pytest.mark.parametrize("took, pause", [
    (2.0, 0.0),  # unanswered for the API's deadline: resent at once
    (0.05, 0.45),  # answered at once: at least half a second from try to try, no tight loop
])
def test_retry_after_zero_resends_at_once_but_never_in_a_tight_loop(monkeypatch, took, pause):
    clock = Clock()
    monkeypatch.setattr(client_module, "time", clock)
    session = Answers(clock, [(took, 503, "0")] * 3 + [(0.01, 202, None)])
    job = iqc.Client("http://iq.invalid", session=session).submit("m", ["x"])
    assert job.id == "job-1" and clock.slept == [pause] * 3
    assert len({key for _at, key in session.sent}) == 1  # every resend with the same key
    starts = [at for at, _key in session.sent]
    assert min(b - a for a, b in zip(starts, starts[1:])) >= client_module.MIN_RETRY_INTERVAL_S


def test_retry_after_one_is_still_waited(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(client_module, "time", clock)
    session = Answers(clock, [(2.0, 503, "1"), (0.01, 202, None)])
    iqc.Client("http://iq.invalid", session=session).submit("m", ["x"])
    assert clock.slept == [1.0]


@pytest.mark.parametrize("environ, url", [
    ({}, "http://127.0.0.1:8000"),
    ({"IQ_PORT": "8123"}, "http://127.0.0.1:8123"),  # the port make run gave the API
    ({"IQ_PORT": "8123", "IQ_API_URL": "http://api.internal:9000/"}, "http://api.internal:9000"),
    ({"IQ_PORT": ""}, "http://127.0.0.1:8000"),
])
def test_the_client_finds_the_api_as_the_stack_sets_it(monkeypatch, environ, url):
    for name in ("IQ_API_URL", "IQ_API_KEY", "IQ_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert iqc.Client().url == url


@pytest.mark.parametrize("typo, hint", [("IQ_API_UR", "IQ_API_URL"), ("IQ_APIURL", "IQ_API_URL"),
                                        ("IQ_API_KYE", "IQ_API_KEY"), ("IQ_PROT", "IQ_PORT")])
def test_a_misspelt_client_variable_is_named_with_the_closest(monkeypatch, typo, hint):
    for name in ("IQ_API_URL", "IQ_API_KEY", "IQ_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(typo, "http://127.0.0.1:8123")
    with pytest.raises(iqc.ConfigurationError,
                       match=f"unknown environment variable {typo}: did you mean {hint}?"):
        iqc.Client()
    err = subprocess.run([sys.executable, "-m", "inference_queue_client", "get", "x"],
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "client")},
                         capture_output=True, text=True, timeout=60)
    assert err.returncode == 2
    assert err.stderr.strip() == f"iq-client: unknown environment variable {typo}: did you " \
                                 f"mean {hint}?"


def test_a_port_that_is_no_port_is_refused(monkeypatch):
    monkeypatch.delenv("IQ_API_URL", raising=False)
    monkeypatch.setenv("IQ_PORT", "80a")
    with pytest.raises(iqc.ConfigurationError, match="IQ_PORT must be a port number .*'80a'"):
        iqc.Client()


def test_no_variable_of_the_stack_reads_as_a_misspelt_client_one():
    """The client may run where the stack's own IQ_ variables are set: none is refused, and
    an explicit url and key need no environment at all."""
    from config.settings import KNOWN_VARIABLES
    from inference_queue_client.environment import misspellings
    assert misspellings({name: "1" for name in KNOWN_VARIABLES}) == []
    assert iqc.Client("http://127.0.0.1:1", api_key="k").url == "http://127.0.0.1:1"
