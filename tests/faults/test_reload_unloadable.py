"""A reload whose new model the pool children cannot load (a file that opens as an archive but
is no TorchScript program, so `make reload`'s check lets it through): the worker's first new
child fails to load and the worker stops (workers/main.py), as a worker that cannot run its
models must. The reload must not then say "done" and exit 0: the stopped worker left the
consuming workers, and the reload counted only those."""
from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
import yaml

from scripts.stack import ROOT, launch, start_worker, wait_until

pytestmark = pytest.mark.slow

QUICK = {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0, "max_batch_size": 4}


def test_a_worker_stopped_by_the_new_models_fails_the_reload(tmp_path):
    weights = tmp_path / "hollow.pt"
    with zipfile.ZipFile(weights, "w") as archive:
        archive.writestr("hollow/readme.txt", b"an archive, but no TorchScript program")
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump({"models": {"quick": QUICK, "ts": {
        "kind": "torchscript", "path": str(weights), "input_shape": [1]}}}))
    stack = launch(tmp_path, {"quick": QUICK}, {}, defaults=True, ready_models=[])
    try:
        stack.workers["a"] = start_worker("a", stack.env, tmp_path, None)
        stack.wait_live(["quick"], 180)
        done = subprocess.run([sys.executable, "-m", "scripts.reload", str(new), "--timeout",
                               "120"], cwd=ROOT, env=stack.env, capture_output=True,
                              text=True, timeout=180)
        wait_until(lambda: stack.workers["a"].proc.poll() is not None, 60, "the worker to stop")
        assert "could not load its models" in stack.workers["a"].tail(300)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "reload done" not in done.stdout
        assert "worker:a@" in done.stdout and "gone: stopped consuming" in done.stdout
    finally:
        stack.stop()
