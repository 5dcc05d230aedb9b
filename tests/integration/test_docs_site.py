"""The documentation site (mkdocs.yml) is built as `make docs` serves it, with --strict, so a
broken link, a page left out of the nav or a generated page that disagrees with the code fails
the suite; headless Chromium then opens its home page and searches it. About two seconds."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from scripts.stack import ROOT
from tests.support.browser import Browser


def build(site, config=ROOT / "mkdocs.yml") -> subprocess.CompletedProcess:
    """Not -q: mkdocs counts for --strict only the warnings it logs."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(config), "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    done = build(site)
    assert done.returncode == 0, done.stderr
    return site


def test_every_page_is_built(site):
    pages = {p.parent.name for p in site.glob("*/index.html")}
    assert {"getting-started", "architecture", "models", "api", "operations", "deploying",
            "reliability", "security", "performance", "extending", "upgrading",
            "configuration"} <= pages
    # The configuration page holds the generated table, the performance page the report.
    assert "<code>IQ_VISIBILITY_TIMEOUT_S</code>" in (site / "configuration/index.html").read_text()
    assert (site / "bench/results/latest.png").is_file()


def test_a_broken_link_fails_the_build(tmp_path):
    docs = shutil.copytree(ROOT / "docs", tmp_path / "docs")
    with open(docs / "api.md", "a") as page:
        page.write("\nSee [the old manual](manual.md).\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text((ROOT / "mkdocs.yml").read_text()
                      .replace("docs_dir: docs", f"docs_dir: {docs}")
                      .replace("scripts/docs_hooks.py", str(ROOT / "scripts/docs_hooks.py")))
    done = build(tmp_path / "site", config)
    assert done.returncode != 0 and "manual.md" in done.stderr, done.stderr


def test_a_browser_opens_the_home_page_and_searches(site, tmp_path):
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with Browser(tmp_path / "profile") as browser:
            browser.open(f"http://127.0.0.1:{server.server_port}/")
            title = browser.wait_for("document.querySelector('article h1')?.firstChild"
                                     ".textContent", 30, "the home page's title")
            assert title == "inference-queue"
            # Material's search, typed into as a reader does: the index loads in a worker.
            browser.evaluate("""(() => {
                const input = document.querySelector('input.md-search__input');
                input.focus(); input.value = 'visibility timeout';
                input.dispatchEvent(new Event('input', {bubbles: true}));
                input.dispatchEvent(new KeyboardEvent('keyup', {bubbles: true}));
            })()""")
            found = browser.wait_for(
                "[...document.querySelectorAll('.md-search-result__item a')]"
                ".map(a => a.getAttribute('href'))", 30, "search results")
            assert any("/reliability/" in href for href in found), found
    finally:
        server.shutdown()
        server.server_close()
