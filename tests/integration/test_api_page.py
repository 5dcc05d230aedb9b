"""The interactive API page (GET /docs: Swagger UI, flask-smorest's page, its files served by
the API from the flask-swagger-ui package) opened in headless Chromium: it renders every
operation of /openapi.json, and fetches nothing from another origin (a deployment's private
network reaches no CDN)."""
from __future__ import annotations

import requests

from tests.support.browser import Browser


def test_the_api_page_renders_every_operation_from_the_api_alone(stack, tmp_path):
    spec = requests.get(f"{stack.api}/openapi.json", timeout=10).json()
    documented = {f"{method.upper()} {path}" for path, ops in spec["paths"].items()
                  for method in ops if method in ("get", "post", "delete")}
    with Browser(tmp_path / "profile") as browser:
        browser.open(f"{stack.api}/docs")
        shown = browser.wait_for(
            """(() => { const ops = [...document.querySelectorAll('.opblock-summary')].map(
                   s => s.querySelector('.opblock-summary-method').innerText + ' ' +
                        s.querySelector('.opblock-summary-path').getAttribute('data-path'));
               return ops.length >= %d ? ops : null; })()""" % len(documented),
            60, "the operations, rendered")
        fetched = browser.evaluate(
            "performance.getEntriesByType('resource').map(e => e.name)")
        title = browser.evaluate("document.querySelector('.info .title')?.innerText")
    assert set(shown) == documented
    assert {"POST /v1/jobs", "GET /v1/jobs/{job_id}", "GET /v1/jobs/{job_id}/events"} <= documented
    assert title.startswith("inference-queue")
    assert fetched and all(url.startswith(f"{stack.api}/") for url in fetched), fetched
    assert f"{stack.api}/docs/assets/swagger-ui-bundle.js" in fetched
    assert f"{stack.api}/openapi.json" in fetched


def test_the_api_page_and_its_files_are_served_without_a_key(stack):
    page = requests.get(f"{stack.api}/docs", timeout=10)
    assert page.status_code == 200 and "docs/assets/swagger-ui-bundle.js" in page.text
    script = requests.get(f"{stack.api}/docs/assets/swagger-ui-bundle.js", timeout=10)
    assert script.status_code == 200 and "SwaggerUIBundle" in script.text[:200_000]
    assert requests.get(f"{stack.api}/docs/assets/nothing.js", timeout=10).status_code == 404
