"""Webhooks: delivered by their own light worker (deliverer.main), signed per tenant
(Standard Webhooks) and checked by docs/webhooks.md's own receiver code, retried without a URL or
payload in any task argument, never to private addresses unless allow-listed (the tests allow
127.0.0.1 and 127.0.0.2 only), and off while no secret is set."""
from __future__ import annotations

import hashlib
import json
import subprocess
import time
import uuid

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from scripts.stack import ROOT, VENV_BIN, launch, start_flower, start_web, start_webhooks, \
    wait_until
from tasks.webhooks import DEAD_LETTERS, receiver_secret, sign, signing_key
from tests.support.workers import prefetch_count
from tests.support.receivers import Receiver, Tarpit, readme_receiver

SECRET = "test-webhook-secret"
TIMEOUT_S = 20  # a whole delivery; the tarpit test needs it well above its own bound
KEYS = {"tenant-a": "key-of-tenant-a-" + uuid.uuid4().hex,
        "tenant-b": "key-of-tenant-b-" + uuid.uuid4().hex}


@pytest.fixture(scope="module")
def hooked(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("webhooks")
    models = {"quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0}}
    stack = launch(workdir, models, {"w": ["quick"]}, env_extra={
        "IQ_WEBHOOK_ALLOW": "127.0.0.1,127.0.0.2", "IQ_WEBHOOK_SECRET": SECRET,
        "IQ_WEBHOOK_BACKOFF_S": "0.2", "IQ_WEBHOOK_RETRIES": "3",
        "IQ_WEBHOOK_TIMEOUT_S": str(TIMEOUT_S), "IQ_WEBHOOK_HOST_CONCURRENCY": "2"})
    hooks = stack.workers["hooks"] = start_webhooks("hooks", stack.env, workdir, concurrency=4)
    # Up before any test reads its metrics (a test may be the first of this module to run).
    wait_until(lambda: requests.get(hooks.extra["metrics_url"], timeout=2).ok, 60,
               "the webhook deliverer's metrics")
    yield stack
    stack.stop()


def submit(stack, inputs, hook):
    return requests.post(f"{stack.api}/v1/jobs", json={"model": "quick", "inputs": inputs,
                                                       "webhook": hook}, timeout=10)


def deliverer_log(stack) -> str:
    return stack.workers["hooks"].log.read_text(errors="replace")


def test_a_signed_webhook_is_delivered_when_the_job_succeeds(hooked):
    receiver = Receiver()
    try:
        job = submit(hooked, ["hello"], {"url": receiver.url}).json()
        assert hooked.finished(job["id"])["status"] == "succeeded"
        wait_until(lambda: receiver.calls, 30, "the webhook")
        call = receiver.calls[0]
        payload = readme_receiver()["verify"](receiver_secret(SECRET, ""), call["headers"],
                                              call["body"])
        assert payload == {"id": job["id"], "model": "quick", "status": "succeeded",
                           "result": {"outputs": [5]}}
    finally:
        receiver.close()


def test_the_readme_receiver_rejects_replays_old_forged_and_other_tenants_deliveries(hooked):
    receiver = Receiver()
    try:
        job = submit(hooked, ["replay me"], {"url": receiver.url}).json()
        wait_until(lambda: receiver.calls, 30, "the webhook")
        headers, body = receiver.calls[0]["headers"], receiver.calls[0]["body"]
    finally:
        receiver.close()
    check = readme_receiver()
    secret = receiver_secret(SECRET, "")
    assert check["verify"](secret, headers, body)["id"] == job["id"]
    with pytest.raises(ValueError, match="already seen"):  # the same request again
        check["verify"](secret, headers, body)
    # Captured, then replayed under a new id with the old (validly signed) timestamp.
    old = int(time.time()) - 3600
    stale = dict(headers, **{"webhook-id": "msg_other", "webhook-timestamp": str(old),
                             "webhook-signature": sign(signing_key(SECRET, ""), "msg_other",
                                                       old, body)})
    with pytest.raises(ValueError, match="tolerance"):
        check["verify"](secret, stale, body)
    fresh = {**headers, "webhook-id": "msg_new"}  # a new id under the old signature
    with pytest.raises(ValueError, match="bad signature"):
        check["verify"](secret, fresh, body)
    tampered = body.replace(b'"succeeded"', b'"failed"')
    with pytest.raises(ValueError, match="bad signature"):
        check["verify"](secret, headers, tampered)
    with pytest.raises(ValueError, match="bad signature"):  # another tenant's secret
        readme_receiver()["verify"](receiver_secret(SECRET, "tenant-a"), headers, body)


def test_a_failing_receiver_is_retried_with_backoff(hooked):
    receiver = Receiver(failures=2)
    try:
        job = submit(hooked, ["!fail"], {"url": receiver.url, "events": ["failed"]}).json()
        assert hooked.finished(job["id"])["status"] == "failed"
        wait_until(lambda: len(receiver.calls) >= 3, 60, "two retries and a delivery")
        assert len(receiver.calls) == 3
        payload = json.loads(receiver.calls[-1]["body"])
        assert payload["status"] == "failed" and payload["error"]["code"] == "inference_error"
    finally:
        receiver.close()


def test_events_not_asked_for_are_not_sent(hooked):
    receiver = Receiver()
    try:
        job = submit(hooked, ["ok"], {"url": receiver.url, "events": ["failed"]}).json()
        assert hooked.finished(job["id"])["status"] == "succeeded"
        marker = submit(hooked, ["!fail"], {"url": receiver.url, "events": ["failed"]}).json()
        wait_until(lambda: receiver.calls, 30, "the later job's webhook")
        # Deliveries are queued in job order; only the failed job's one arrived.
        assert [json.loads(c["body"])["id"] for c in receiver.calls] == [marker["id"]]
    finally:
        receiver.close()


def test_a_redirect_is_a_final_answer(hooked):
    receiver = Receiver(status=302)
    try:
        job = submit(hooked, ["moved"], {"url": receiver.url}).json()
        line = f"webhook for job {job['id']}: 127.0.0.1 answered 302; not retried"
        wait_until(lambda: line in deliverer_log(hooked), 30, "the 302 to be taken as final")
        assert len(receiver.calls) == 1
    finally:
        receiver.close()


def deliverer_metrics(stack) -> dict[tuple[str, tuple], float]:
    """The deliverer's samples, by name and labels, from its own metrics endpoint."""
    text = requests.get(stack.workers["hooks"].extra["metrics_url"], timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_exhausted_retries_log_job_host_and_status_never_payload_or_url(hooked):
    receiver = Receiver(status=500)
    token = uuid.uuid4().hex
    retried, given_up = ("iq_webhook_attempts_total", (("outcome", "retry"),)), \
        ("iq_webhook_given_up_total", ())
    before = deliverer_metrics(hooked)
    try:
        job = submit(hooked, ["hello"], {"url": f"{receiver.url}/{token}?sig={token}"}).json()
        line = f"webhook for job {job['id']} to 127.0.0.1 given up after 4 attempts; last: 500"
        wait_until(lambda: line in deliverer_log(hooked), 60, "the retries to run out")
        assert len(receiver.calls) == 4  # the first attempt and IQ_WEBHOOK_RETRIES more
        after = deliverer_metrics(hooked)  # counted before the line is logged
        assert after[retried] - before.get(retried, 0) >= 4
        assert after[given_up] - before.get(given_up, 0) >= 1
        assert after[("iq_webhook_attempt_seconds_count", ())] >= 4
        # Kept in the dead-letter list (its host, never its URL).
        dead = [json.loads(e) for e in hooked.redis.lrange(DEAD_LETTERS, 0, -1)]
        mine = [e for e in dead if e["job_id"] == job["id"]]
        assert [(e["event"], e["attempts"], e["last"], e["host"]) for e in mine] == \
            [("succeeded", 4, 500, "127.0.0.1")]
        assert token not in json.dumps(mine)
        logs = "".join(p.read_text(errors="replace") for p in hooked.workdir.glob("*.log"))
        assert token not in logs
        assert "'outputs'" not in logs and '"outputs"' not in logs  # the payload's result
    finally:
        receiver.close()


def test_the_deliverer_holds_two_deliveries_a_thread(hooked):
    """Not the model workers' prefetch (two full batches of the largest model, 64 a thread
    here): a second deliverer would idle while one held hundreds (deliverer/main.py)."""
    assert prefetch_count(hooked, "hooks") == 2 * 4


def test_a_tarpit_receiver_does_not_hold_up_other_receivers(hooked):
    """8 deliveries to a receiver that answers one byte every 2 s, then one to a normal
    receiver: the tarpit holds its per-host share of the deliverer's 4 threads (2) until the
    delivery deadline, and the normal one is delivered meanwhile."""
    tarpit, receiver = Tarpit(interval=2.0, host="127.0.0.2"), Receiver()
    try:
        for i in range(8):
            assert submit(hooked, [f"slow {i}"], {"url": tarpit.url}).status_code == 202
        wait_until(lambda: tarpit.accepted >= 2, 30, "the tarpit's first deliveries")
        job = submit(hooked, ["quick"], {"url": receiver.url}).json()
        # Generous: a free thread delivers in well under a second; a held one would wait
        # for the tarpit's deadline (TIMEOUT_S).
        wait_until(lambda: receiver.calls, TIMEOUT_S * 0.75, "the normal receiver's webhook")
        assert json.loads(receiver.calls[0]["body"])["id"] == job["id"]
        # Meanwhile the tarpit never held more than its cap, and nothing of it finished.
        assert tarpit.most_open == 2 and tarpit.accepted == 2 and tarpit.ended == 0
    finally:
        tarpit.close()
        receiver.close()


@pytest.mark.parametrize("url", [
    "http://10.1.2.3/hook", "http://192.168.0.10/hook", "http://169.254.169.254/latest",
    "http://[::1]:8080/hook", "http://0.0.0.0/hook", "ftp://127.0.0.1/hook",
    "http://user:pw@127.0.0.1/hook", "not a url", "http://127.0.0.1:99999/hook",
])
def test_private_loopback_link_local_and_malformed_targets_are_refused(hooked, url):
    r = submit(hooked, ["x"], {"url": url})
    assert r.status_code == 422, r.text
    messages = r.json()["error"]["fields"]["webhook.url"]
    assert not any("10.1.2.3" in m or "::1" in m for m in messages)  # no DNS oracle
    if url.startswith(("http://10.", "http://192.", "http://169.", "http://[::1]", "http://0.")):
        assert "IQ_WEBHOOK_ALLOW" in messages[0], messages  # the setting that would allow it


def test_webhooks_are_refused_while_no_secret_is_set(hooked):
    env = {k: v for k, v in hooked.env.items() if k != "IQ_WEBHOOK_SECRET"}
    web = start_web(env, hooked.workdir)
    try:
        r = requests.post(f"{web.extra['url']}/v1/jobs", timeout=10, json={
            "model": "quick", "inputs": ["x"], "webhook": {"url": "http://127.0.0.1:9/hook"}})
        assert r.status_code == 422, r.text
        assert "IQ_WEBHOOK_SECRET" in r.json()["error"]["fields"]["webhook"][0]
        r = requests.post(f"{web.extra['url']}/v1/jobs", timeout=10,
                          json={"model": "quick", "inputs": ["x"]})
        assert r.status_code == 202  # only webhooks are off
    finally:
        web.stop()


def test_an_api_told_webhooks_are_on_needs_no_secret(hooked):
    """As make run starts it: the deliverer holds the secret, the API only IQ_WEBHOOKS_ENABLED."""
    env = {k: v for k, v in hooked.env.items() if k != "IQ_WEBHOOK_SECRET"}
    web = start_web(dict(env, IQ_WEBHOOKS_ENABLED="true"), hooked.workdir)
    receiver = Receiver()
    try:
        r = requests.post(f"{web.extra['url']}/v1/jobs", timeout=10, json={
            "model": "quick", "inputs": ["told"], "webhook": {"url": receiver.url}})
        assert r.status_code == 202, r.text
        wait_until(lambda: receiver.calls, 30, "the webhook")
        call = receiver.calls[0]
        assert readme_receiver()["verify"](receiver_secret(SECRET, ""), call["headers"],
                                           call["body"])["id"] == r.json()["id"]
    finally:
        receiver.close()
        web.stop()


def test_the_deliverer_will_not_start_with_the_placeholder_secret(hooked, tmp_path):
    env = dict(hooked.env, IQ_WEBHOOK_SECRET="change-me")
    deliverer = start_webhooks("placeholder", env, tmp_path)
    try:
        assert deliverer.proc.wait(60) != 0
        assert "IQ_WEBHOOK_SECRET" in deliverer.log.read_text()
    finally:
        deliverer.stop()


def keyed_api(stack, workdir):
    """A second API on the same stack with two API keys: each key's jobs are its tenant's."""
    keys_file = workdir / "keys.yaml"
    keys_file.write_text(yaml.safe_dump({"keys": [
        {"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest()}
        for name, key in KEYS.items()]}))
    return start_web(dict(stack.env, IQ_API_KEYS_FILE=str(keys_file)), workdir)


def test_each_tenants_deliveries_are_signed_with_its_own_key(hooked, tmp_path):
    web = keyed_api(hooked, tmp_path)
    receivers = {name: Receiver() for name in KEYS}
    try:
        for name, key in KEYS.items():
            r = requests.post(f"{web.extra['url']}/v1/jobs", timeout=10,
                              headers={"Authorization": f"Bearer {key}"},
                              json={"model": "quick", "inputs": [name],
                                    "webhook": {"url": receivers[name].url}})
            assert r.status_code == 202, r.text
        wait_until(lambda: all(r.calls for r in receivers.values()), 30, "both webhooks")
        check = readme_receiver()
        for name, receiver in receivers.items():
            call = receiver.calls[0]
            other = next(n for n in KEYS if n != name)
            for wrong in (receiver_secret(SECRET, other), receiver_secret(SECRET, "")):
                with pytest.raises(ValueError, match="bad signature"):
                    check["verify"](wrong, call["headers"], call["body"])
            payload = check["verify"](receiver_secret(SECRET, name), call["headers"],
                                      call["body"])
            assert payload["status"] == "succeeded"
    finally:
        for receiver in receivers.values():
            receiver.close()
        web.stop()


def celery_cli(stack, *args: str) -> str:
    done = subprocess.run([str(VENV_BIN / "celery"), "-A", "tasks.cli", *args], cwd=ROOT,
                          env=stack.env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_no_inspector_sees_a_secret_a_receivers_url_or_a_payload(hooked, tmp_path):
    """A delivery being retried (its receiver fails), seen through `celery inspect` and
    Flower: neither the receiver's URL and token, nor the payload, nor Redis's passwords or
    the webhook secret appear anywhere."""
    token = uuid.uuid4().hex
    receiver = Receiver(failures=2)
    flower = start_flower(hooked.env, tmp_path, "ops:flower-test-password")
    try:
        auth = ("ops", "flower-test-password")
        wait_until(lambda: any(n.startswith("hooks@") for n in requests.get(
            f"{flower.extra['url']}/api/workers", params={"refresh": 1}, auth=auth,
            timeout=10).json()), 30,
            "Flower to see the deliverer")
        url = f"{receiver.url}/{token}?token={token}"
        job = submit(hooked, [f"secret input {token}"], {"url": url}).json()
        wait_until(lambda: len(receiver.calls) >= 2, 30, "a delivery and its first retry")
        shown = [celery_cli(hooked, "inspect", "conf"),
                 celery_cli(hooked, "inspect", "scheduled"),
                 celery_cli(hooked, "inspect", "reserved")]
        shown += [requests.get(f"{flower.extra['url']}/api/workers", params={"refresh": 1},
                               auth=auth, timeout=30).text,
                  requests.get(f"{flower.extra['url']}/api/tasks", auth=auth, timeout=10).text]
        wait_until(lambda: len(receiver.calls) >= 3, 30, "the delivery")
        deliveries = [t for t in requests.get(f"{flower.extra['url']}/api/tasks", auth=auth,
                                              timeout=10).json().values()
                      if t["name"] == "iq.webhook.deliver" and job["id"] in t["kwargs"]]
        assert deliveries and deliveries[0]["retries"] >= 1, deliveries  # seen, and retried
        shown.append(json.dumps(deliveries))
        assert "iq_settings" in shown[0]  # the settings are there, less their secrets
        secrets = [token, SECRET, hooked.redis_svc.extra["password"],
                   hooked.redis_svc.extra["app_password"], "outputs"]
        for text in shown:
            for secret in secrets:
                assert secret not in text, (secret, text[:2000])
    finally:
        receiver.close()
        flower.stop()


def test_deliveries_sent_through_flower_are_signed_only_for_the_jobs_own_event_once(hooked,
                                                                                   tmp_path):
    """Flower's send-task (an operator's login) asks the deliverer for another event of a
    succeeded job, for its own event again under a new delivery id, and (the re-attack, F4)
    under the delivered one's own id: none is sent. With
    Flower read-only (FLOWER_READ_ONLY, docs/security.md) it cannot send a task at all."""
    receiver = Receiver()
    flower = start_flower(hooked.env, tmp_path, "ops:flower-test-password")
    (tmp_path / "ro").mkdir()
    read_only = start_flower(dict(hooked.env, FLOWER_READ_ONLY="true"), tmp_path / "ro",
                             "ops:flower-test-password")
    auth = ("ops", "flower-test-password")
    try:
        job = submit(hooked, ["sign me"], {"url": receiver.url, "events": ["succeeded"]}).json()
        assert hooked.finished(job["id"])["status"] == "succeeded"
        wait_until(lambda: receiver.calls, 30, "the job's own webhook")
        own_id = receiver.calls[0]["headers"]["webhook-id"]
        wait_until(lambda: f"for job {job['id']} delivered" in deliverer_log(hooked), 30,
                   "the deliverer to record the answer")
        for event, task_id in (("failed", None), ("cancelled", None), ("succeeded", None),
                               ("succeeded", own_id)):
            options = {"task_id": task_id} if task_id else {}
            sent = requests.post(f"{flower.extra['url']}/api/task/send-task/iq.webhook.deliver",
                                 json={"kwargs": {"job_id": job["id"], "event": event},
                                       **options}, auth=auth, timeout=30)
            assert sent.status_code == 200, sent.text
            denied = requests.post(
                f"{read_only.extra['url']}/api/task/send-task/iq.webhook.deliver",
                json={"kwargs": {"job_id": job["id"], "event": event}}, auth=auth, timeout=30)
            assert denied.status_code == 403
        wait_until(lambda: deliverer_log(hooked).count(f"for job {job['id']} dropped") == 4,
                   30, "the deliverer to drop the four")
        log = deliverer_log(hooked)
        assert f"webhook failed for job {job['id']} dropped: the event is not the job's status" \
            in log
        assert f"webhook succeeded for job {job['id']} dropped: not the delivery the job " \
            "queued" in log
        assert f"webhook succeeded for job {job['id']} dropped: the job's delivery was " \
            "answered already" in log
        assert len(receiver.calls) == 1
    finally:
        receiver.close()
        flower.stop()
        read_only.stop()
