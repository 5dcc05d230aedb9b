"""The GPU check's rehearsal on the CPU (`python -m scripts.gpu_check --rehearse-cpu`): the
harness `make gpu-check` runs on a GPU host, end to end here, where there is no GPU, so that it
keeps up with the code. Its own private stack (a worker with two children)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from scripts.stack import ROOT

CUDA_ONLY = {"cuda_contexts", "devices", "gpu_memory"}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_rehearsal_passes_every_check_that_needs_no_gpu(tmp_path):
    out = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--rehearse-cpu"],
                         cwd=ROOT, env=dict(os.environ, OUT=str(tmp_path)),
                         capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "ready on cpu" in (tmp_path / "gpu_check_worker-gpu.log").read_text()  # for $OUT
    assert report["mode"] == "rehearse-cpu" and report["ok"] is True, report
    checks = report["checks"]
    assert {name for name, c in checks.items() if c == "skipped: no CUDA"} == CUDA_ONLY
    ran = {name: c for name, c in checks.items() if name not in CUDA_ONLY}
    assert set(ran) == {"children", "outputs", "metrics", "oom"}
    assert all(c["ok"] is True for c in ran.values()), ran
    # Both children loaded both models, and jobs ran in children, never in the parent.
    children = checks["children"]
    assert all(len(set(loaded)) == 2 for loaded in children["children_by_model"].values())
    assert len(children["pool_pids"]) == 2 and children["parent_pid"] not in children["pool_pids"]
    assert children["ran_in_pids"] and set(children["ran_in_pids"]) <= set(children["pool_pids"])
    # The simulated out-of-memory halved 16 items down to the 4 that fit.
    assert checks["oom"]["call_sizes"][:3] == [16, 8, 4]
