"""A job's event stream read by a real browser: headless Chromium's own `EventSource`, on a tiny
page served from loopback, follows a job that spans several model calls to its end and posts
what it saw back to the test. The page's server passes /v1/ through to the API byte for byte,
so that the stream is the page's own origin, as behind a site's reverse proxy. Skipped, saying
why, where Chromium is not installed (`make test` installs Debian's `chromium` as root)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import pytest
import requests

from scripts.stack import wait_until
from tests.support.tools import require

FINAL = ("succeeded", "failed", "cancelled", "expired")

PAGE = """<!doctype html><meta charset="utf-8"><title>events</title><script type="module">
const seen = [];
const report = (outcome) => fetch("/result", {method: "POST",
  body: JSON.stringify({outcome, seen})});
// The job is submitted when the page asks for it, so the stream opens as the job starts.
const id = await (await fetch("/job", {method: "POST"})).text();
const source = new EventSource(`/v1/jobs/${id}/events`);
for (const name of ["queued", "running", "progress", ...%(final)s]) {
  source.addEventListener(name, (event) => {
    const job = JSON.parse(event.data);
    seen.push({name, id: event.lastEventId, status: job.status, progress: job.progress,
               outputs: job.result ? job.result.outputs.length : null});
    if (%(final)s.includes(name)) { source.close(); report("ended"); }
  });
}
source.onerror = () => { if (source.readyState === EventSource.CLOSED) report("error"); };
</script>"""


class _Page(BaseHTTPRequestHandler):
    """Serves PAGE at /, passes /v1/ through to the API and takes the page's report at
    /result."""
    page = b""
    api = ""
    submit: Callable[[], str] = staticmethod(lambda: "")
    reports: list[dict] = []

    def do_GET(self) -> None:
        if self.path.startswith("/v1/"):
            self._pass_through()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(self.page)))
        self.end_headers()
        self.wfile.write(self.page)

    def _pass_through(self) -> None:
        sent = {k: v for k, v in self.headers.items() if k in ("Accept", "Last-Event-ID")}
        with requests.get(f"{self.api}{self.path}", headers=sent, stream=True,
                          timeout=60) as answer:
            self.send_response(answer.status_code)
            self.send_header("Content-Type", answer.headers.get("Content-Type", ""))
            self.end_headers()  # HTTP/1.0: the body ends when the connection closes
            for chunk in iter(lambda: answer.raw.read1(65536), b""):  # as it comes
                self.wfile.write(chunk)
                self.wfile.flush()

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        body = self.rfile.read(length)
        if self.path == "/job":
            job_id = _Page.submit().encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(job_id)))
            self.end_headers()
            self.wfile.write(job_id)
            return
        _Page.reports.append(json.loads(body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_a_browsers_event_source_follows_a_job_to_its_end(stack, tmp_path):
    browser = require("chromium")
    _Page.page = (PAGE % {"final": json.dumps(list(FINAL))}).encode()
    _Page.api, _Page.reports = stack.api, []
    # 16 inputs of a model that takes 2 a call of 300 ms: 8 calls, each counted as it ends.
    _Page.submit = staticmethod(lambda: stack.submit("chunky", [f"item {i}" for i in
                                                                range(16)])["id"])
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    log = open(tmp_path / "browser.log", "wb")
    browser = subprocess.Popen(
        [browser, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr",
         f"http://127.0.0.1:{server.server_port}/"],
        stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    try:
        wait_until(lambda: _Page.reports, 90, "the page's report")
    finally:
        os.killpg(browser.pid, signal.SIGKILL)
        browser.wait(10)
        log.close()
        server.shutdown()
        server.server_close()
    [report] = _Page.reports
    seen = report["seen"]
    assert report["outcome"] == "ended", (report, (tmp_path / "browser.log").read_text()[-3000:])
    names = [event["name"] for event in seen]
    assert names[-1] == "succeeded" and names.count("succeeded") == 1, names
    done = [event["progress"]["items_done"] for event in seen if event["name"] == "progress"]
    assert done and done == sorted(done) and 0 < done[0] < 16, seen
    assert seen[-1]["progress"] == {"items_done": 16, "items": 16}
    assert seen[-1]["outputs"] == 16 and seen[-1]["status"] == "succeeded"
    assert all(event["id"] for event in seen)  # each event has an id to resume after
