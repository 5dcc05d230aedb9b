"""A job's event stream read by a real browser: headless Chromium's own `EventSource`, on a tiny
page served from loopback, follows a job that spans several model calls to its end and posts
what it saw back to the test. Skipped, saying why, where Chromium is not installed (`make test`
installs Debian's `chromium` when it runs as root)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from scripts.stack import wait_until

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
FINAL = ("succeeded", "failed", "cancelled", "expired")

PAGE = """<!doctype html><meta charset="utf-8"><title>events</title><script>
const seen = [];
const report = (outcome) => fetch("/result", {method: "POST",
  body: JSON.stringify({outcome, seen})});
const source = new EventSource(%(url)s);
for (const name of ["queued", "running", "progress", %(final)s]) {
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
    """Serves PAGE at / and takes the page's report at /result."""
    page = b""
    reports: list[dict] = []

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(self.page)))
        self.end_headers()
        self.wfile.write(self.page)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        _Page.reports.append(json.loads(self.rfile.read(length)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.mark.skipif(BROWSER is None, reason="Chromium is not installed (Debian: apt-get "
                                            "install chromium; make test does it as root)")
def test_a_browsers_event_source_follows_a_job_to_its_end(stack, tmp_path):
    job = stack.submit("chunky", [f"item {i}" for i in range(12)])  # 6 calls of 2 items
    url = f"{stack.api}/v1/jobs/{job['id']}/events"
    _Page.page = (PAGE % {"url": json.dumps(url), "final": json.dumps(list(FINAL))}).encode()
    _Page.reports = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # The page is on another port than the API: another origin, which the stream does not
    # allow (no CORS headers), so the browser is told to ignore that rule.
    browser = subprocess.Popen(
        [BROWSER, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", "--disable-web-security", f"--user-data-dir={tmp_path / 'profile'}",
         f"http://127.0.0.1:{server.server_port}/"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: _Page.reports, 90, "the page's report")
    finally:
        os.killpg(browser.pid, signal.SIGKILL)
        browser.wait(10)
        server.shutdown()
    [report] = _Page.reports
    seen = report["seen"]
    assert report["outcome"] == "ended", report
    names = [event["name"] for event in seen]
    assert names[-1] == "succeeded" and names.count("succeeded") == 1, names
    assert names[0] in ("queued", "running"), names
    done = [event["progress"]["items_done"] for event in seen if event["name"] == "progress"]
    assert done and done == sorted(done) and 0 < done[0] < 12, seen
    assert seen[-1]["progress"] == {"items_done": 12, "items": 12}
    assert seen[-1]["outputs"] == 12 and seen[-1]["status"] == "succeeded"
    assert all(event["id"] for event in seen)  # each event has an id to resume after
