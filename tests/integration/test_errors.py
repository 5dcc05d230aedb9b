"""Every validation and HTTP error is JSON `{"error": {"code", "message", "fields"?}}`."""
from __future__ import annotations

import json

import pytest
import requests


def post(stack, body, content_type="application/json", raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    return requests.post(f"{stack.api}/v1/jobs", data=data,
                         headers={"Content-Type": content_type}, timeout=10)


def assert_error(r, status: int, code: str, fields: set[str] | None = None):
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == code and isinstance(err["message"], str) and err["message"]
    if fields is not None:
        assert set(err["fields"]) == fields, err
    return err


def test_malformed_json_is_400(stack):
    assert_error(post(stack, None, raw=b'{"model": '), 400, "malformed_request")


def test_invalid_utf8_is_400(stack):
    assert_error(post(stack, None, raw=b'{"model": "\xff\xfe"}'), 400, "malformed_request")


def test_deeply_nested_json_is_400_not_500(stack):
    assert_error(post(stack, None, raw=b"[" * 100_000 + b"]" * 100_000), 400,
                 "malformed_request")


def test_wrong_content_type_is_415(stack):
    r = post(stack, None, content_type="text/plain", raw=b"model=minilm-embed")
    assert_error(r, 415, "unsupported_media_type")


def test_body_over_limit_is_413(stack):
    big = {"model": "minilm-embed", "inputs": ["x" * 2_000_000]}
    assert_error(post(stack, big), 413, "payload_too_large")


def test_body_must_be_an_object(stack):
    assert_error(post(stack, ["minilm-embed"]), 422, "validation_error", {"_schema"})


@pytest.mark.parametrize("body, fields", [
    ({"model": "no-such-model", "inputs": ["x"]}, {"model"}),
    ({"inputs": ["x"]}, {"model"}),
    ({"model": 5, "inputs": ["x"]}, {"model"}),
    ({"model": "minilm-embed"}, {"inputs"}),
    ({"model": "minilm-embed", "inputs": []}, {"inputs"}),
    ({"model": "minilm-embed", "inputs": ["x"] * 65}, {"inputs"}),
    ({"model": "minilm-embed", "inputs": "just a string"}, {"inputs"}),
    ({"model": "minilm-embed", "inputs": ["ok", "y" * 5001]}, {"inputs.1"}),
    ({"model": "minilm-embed", "inputs": ["ok", 7, None]}, {"inputs.1", "inputs.2"}),
    ({"model": "minilm-embed", "inputs": ["x"], "options": {"labels": ["a"]}},
     {"options.labels"}),
    ({"model": "minilm-embed", "inputs": ["x"], "options": []}, {"options"}),
    ({"model": "minilm-embed", "inputs": ["x"], "priority": "urgent"}, {"priority"}),
    ({"model": "minilm-classify", "inputs": ["x"], "options": {"labels": []}},
     {"options.labels"}),
    ({"model": "minilm-classify", "inputs": ["x"], "options": {"labels": ["a", 3]}},
     {"options.labels.1"}),
    ({"model": "ts-affine", "inputs": [[1, 2, 3]]}, {"inputs.0"}),
    ({"model": "ts-affine", "inputs": [[1, 2, 3, "4"]]}, {"inputs.0"}),
    ({"model": "ts-affine", "inputs": [[1, 2, 3, True]]}, {"inputs.0"}),
    ({"model": "ts-affine", "inputs": [[[1], 2, 3, 4]]}, {"inputs.0"}),
])
def test_validation_errors_name_each_bad_field(stack, body, fields):
    err = assert_error(post(stack, body), 422, "validation_error", fields)
    assert all(isinstance(m, list) and m for m in err["fields"].values())


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_rejected(stack, number):
    raw = ('{"model": "ts-affine", "inputs": [[1, 2, 3, %s]]}' % number).encode()
    assert_error(post(stack, None, raw=raw), 422, "validation_error", {"inputs.0"})


def test_wrong_method_is_405(stack):
    r = requests.delete(f"{stack.api}/v1/models", timeout=5)
    err = assert_error(r, 405, "method_not_allowed")
    assert "GET" in r.headers["Allow"] and err


def test_unknown_route_is_json_404(stack):
    assert_error(requests.get(f"{stack.api}/v2/nothing", timeout=5), 404, "not_found")



# Alone (serial): a refused connection is retried as long as another try fits in the request's
# deadline (2 s), so the last try ends a backoff's pause before it; a neighbour that stalls
# this process past that turns the unreachable Redis into a timeout (Retry-After 0: its job
# perhaps stored, app/submission.py), as CI saw once.
@pytest.mark.serial
def test_redis_unreachable_is_503_within_seconds(tmp_path):
    """An API whose Redis is down answers 503 with Retry-After, quickly, for every route that
    needs Redis; /healthz (process alive) still answers 200."""
    import time

    from app import create_app
    from scripts.stack import free_port

    app = create_app({"redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    client = app.test_client()
    for method, path, body in [("post", "/v1/jobs", {"model": "minilm-embed", "inputs": ["x"]}),
                               ("get", f"/v1/jobs/{__import__('uuid').uuid4()}", None),
                               ("get", "/v1/models", None)]:
        started = time.monotonic()
        r = getattr(client, method)(path, json=body)
        assert time.monotonic() - started < 10
        assert r.status_code == 503, r.get_data(as_text=True)
        assert r.json["error"]["code"] == "unavailable"
        assert r.headers["Retry-After"] == "1"  # a restarting Redis is back within seconds
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json["checks"]["redis"]["ok"] is False
    assert client.get("/healthz").status_code == 200
    app.extensions["iq.store"].waiter.close()  # or it retries its Redis for the session



@pytest.mark.parametrize("raw, fields", [
    # Each of these was a 500 once: an unhashable model, a port out of range, an integer
    # too large for a float.
    (b'{"model": [], "inputs": ["a"]}', {"model"}),
    (b'{"model": {"a": 1}, "inputs": ["a"]}', {"model"}),
    (b'{"model": "minilm-embed", "inputs": ["a"], "webhook": {"url": "http://example.com:99999/"}}',
     {"webhook.url"}),
    (b'{"model": "ts-affine", "inputs": [[1, 1' + b"0" * 400 + b', 0, 0]]}', {"inputs.0"}),
    # Numbers float32 cannot hold: refused, not turned into null outputs.
    (b'{"model": "ts-affine", "inputs": [[1e300, 0, 0, 0]]}', {"inputs.0"}),
    (b'{"model": "ts-affine", "inputs": [[-3.5e38, 0, 0, 0]]}', {"inputs.0"}),
])
def test_inputs_that_once_broke_the_api_are_422_naming_the_field(stack, raw, fields):
    assert_error(post(stack, None, raw=raw), 422, "validation_error", fields)


def test_bad_requests_get_small_answers(stack):
    # Lengths are checked before items: 100,000 bad inputs are one error on `inputs`.
    r = post(stack, {"model": "minilm-embed", "inputs": [7] * 100_000})
    err = assert_error(r, 422, "validation_error", {"inputs"})
    assert "64" in err["fields"]["inputs"][0] and len(r.content) < 1000
    # 60,000 unknown keys: 30 named, the rest counted.
    many_keys = {"model": "minilm-embed", "inputs": ["x"], **{f"k{i}": 1 for i in range(60_000)}}
    r = post(stack, many_keys)
    err = assert_error(r, 422, "validation_error")
    assert len(err["fields"]) == 30 and err["fields_omitted"] == 60_000 - 30
    assert len(r.content) < 5000
    # 64 inputs, each wrong: every one named, up to the cap.
    r = post(stack, {"model": "minilm-embed", "inputs": [{"a": [1] * 1000}] * 64})
    err = assert_error(r, 422, "validation_error")
    assert len(err["fields"]) == 30 and err["fields_omitted"] == 34


def _chunked(stack, body: bytes) -> requests.Response:
    def chunks():
        for i in range(0, len(body), 65_536):
            yield body[i:i + 65_536]

    return requests.post(f"{stack.api}/v1/jobs", data=chunks(),
                         headers={"Content-Type": "application/json"}, timeout=30)


def test_a_chunked_body_over_the_limit_is_413_like_one_with_a_length(stack):
    job = {"model": "minilm-embed", "inputs": ["x" * 2_000_000]}
    r = _chunked(stack, json.dumps(job).encode())
    assert_error(r, 413, "payload_too_large")
    r = _chunked(stack, json.dumps({"model": "minilm-embed", "inputs": ["chunked"]}).encode())
    assert r.status_code == 202, r.text


@pytest.mark.parametrize("wait", ["0", "-1", "31", "abc", "nan", "inf", "1e999", ""])
def test_a_bad_wait_is_422_naming_it(stack, wait):
    job = stack.submit("synthetic", ["w"])
    r = requests.get(f"{stack.api}/v1/jobs/{job['id']}", params={"wait": wait}, timeout=10)
    assert_error(r, 422, "validation_error", {"wait"})


@pytest.mark.parametrize("method, path", [("GET", "//v1//models"), ("GET", "/v1//models"),
                                          ("POST", "//v1//jobs")])
def test_doubled_slashes_are_a_json_404_not_a_redirect(stack, method, path):
    r = requests.request(method, f"{stack.api}{path}", headers={"Host": "evil.example"},
                         allow_redirects=False, timeout=10)
    assert "Location" not in r.headers
    assert_error(r, 404, "not_found")
