"""The images and the composed stack (`make container-check`): built from the Containerfile,
started from compose.yaml with podman, and serving a job. Building takes minutes (ten on a
two-core machine), more than CI can give, so the suite runs it only when asked
(CONTAINER_TESTS=1, and podman installed: podman-compose comes with requirements/dev.txt);
what the files alone can show is checked on every run (tests/unit/test_container_files.py).
The script itself says what it skipped for (exit status 77)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from scripts.stack import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.skipif(os.environ.get("CONTAINER_TESTS") != "1",
                    reason="building the images takes minutes: make container-check, or "
                           "CONTAINER_TESTS=1 make test")
@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")
@pytest.mark.timeout(1800)
def test_the_composed_images_serve_a_job():
    done = subprocess.run(["scripts/container_check.sh"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1750)
    if done.returncode == 77:
        pytest.skip(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "container check passed" in done.stdout
