"""Fixtures: unit tests need nothing; integration tests share one real stack per session
(private redis-server, two prefork `celery worker` processes, gunicorn serving the app),
started once: its tests run in one of xdist's processes (tests/support/parallel.py)."""
from __future__ import annotations

from pathlib import Path

import prometheus_client.values  # noqa: F401  (before any test runs gunicorn.conf.py: below)
import pytest

from tests.support.models import (MINILM_PACKAGE, VISION_LABELS, VISION_PREPROCESS,
                                  build_export_model, build_image_model,
                                  build_sequence_classifier, minilm_folder)
# The hooks that spread the suite over xdist's processes.
from tests.support.parallel import (pytest_collection_modifyitems,  # noqa: F401
                                    pytest_runtest_protocol)  # noqa: F401
from scripts.stack import Stack, launch, start_redis

# prometheus_client's values module picks its kind of value once, when it is imported: the
# multiprocess kind if PROMETHEUS_MULTIPROC_DIR is set then. gunicorn.conf.py sets it and
# imports the module, as gunicorn's master must; a test that runs that file in this process
# (tests/unit/test_one_send.py, test_web_workers.py) before anything else imported the module
# would leave the whole process in multiprocess mode without a folder, and each later test of
# the app would fail on its first count. Imported here first, the file's import is a no-op.


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


def shared_models(ts_model: Path, workdir: Path) -> dict:
    return {
        # A Hugging Face folder by `path:` (the packaged one); minilm-classify loads the same
        # weights through `package:`.
        "minilm-embed": {"kind": "embedding", "path": str(minilm_folder()), "max_batch_size": 16,
                         "max_wait_ms": 5, "max_inputs": 64, "max_input_chars": 5000},
        "minilm-classify": {"kind": "classification", "package": MINILM_PACKAGE,
                            "labels": ["sports", "politics", "cooking"], "max_batch_size": 16,
                            "max_inputs": 16, "max_input_chars": 5000},
        "ts-affine": {"kind": "torchscript", "path": str(ts_model), "input_shape": [4],
                      "input_dtype": "float32", "max_batch_size": 8, "max_inputs": 16},
        "export-linear": {"kind": "export", "path": str(build_export_model(workdir / "m.pt2")),
                          "input_shape": [4], "max_batch_size": 8, "max_inputs": 16},
        "tiny-seqcls": {"kind": "sequence-classification", "max_batch_size": 8,
                        "path": str(build_sequence_classifier(workdir / "seqcls"))},
        "tiny-vision": {"kind": "image", "path": str(build_image_model(workdir / "vision.pt2")),
                        "labels": VISION_LABELS, "preprocess": VISION_PREPROCESS,
                        "top_k": 3, "max_batch_size": 8, "max_inputs": 8,
                        "max_image_bytes": 150_000, "max_image_pixels": 1_000_000},
        # The same model on the default image limits (10 MiB, 40 MP): hostile images.
        "vision-defaults": {"kind": "image", "path": str(workdir / "vision.pt2"),
                            "labels": VISION_LABELS, "preprocess": VISION_PREPROCESS},
        # Synthetic models on their own worker: a batch costs base_ms + per_item_ms * n.
        "synthetic": {"kind": "synthetic", "base_ms": 300, "per_item_ms": 1,
                      "max_batch_size": 64, "max_wait_ms": 5, "max_inputs": 64},
        "sleepy": {"kind": "synthetic", "base_ms": 3000, "per_item_ms": 0,
                   "max_batch_size": 4, "max_inputs": 4},
        # A job of more than 2 inputs spans several model calls of 150 ms: progress to see.
        "chunky": {"kind": "synthetic", "base_ms": 150, "per_item_ms": 0, "max_batch_size": 2,
                   "max_inputs": 16},
        # A window far longer than any test: only the idle-worker rule can dispatch at once.
        "patient": {"kind": "synthetic", "base_ms": 10, "per_item_ms": 0,
                    "max_batch_size": 64, "max_wait_ms": 120000},
    }


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    workdir = tmp_path_factory.mktemp("stack")
    models = shared_models(build_torchscript_model(workdir / "affine.pt"), workdir)
    stack = launch(workdir, models, {
        "text": ["minilm-embed", "minilm-classify", "ts-affine", "export-linear",
                 "tiny-seqcls", "tiny-vision", "vision-defaults"],
        "synth": ["synthetic", "sleepy", "patient", "chunky"],
    }, env_extra={"IQ_IMAGE_URL_ALLOW": "127.0.0.1"})  # the image URL tests' own server
    yield stack
    stack.stop()


@pytest.fixture
def api(stack) -> str:
    return stack.api


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A private redis-server alone, for the tests of what talks to Redis without a worker."""
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def clean_admin(redis_server):
    """The private redis-server as its admin, emptied for the test, its memory cap lifted
    after it."""
    import redis

    client = redis.Redis.from_url(redis_server.extra["admin_url"], decode_responses=True)
    client.flushdb()
    yield client
    client.config_set("maxmemory", 0)
