"""The images and the composed stack (`make container-check`): built from the Containerfile,
started from compose.yaml with podman, and serving a job. Minutes of building the first time,
so it runs only where podman is installed (podman-compose comes with requirements/dev.txt),
and says why it skips elsewhere; the script itself says what it skipped for (exit status 77)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from scripts.stack import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")
@pytest.mark.timeout(1800)
def test_the_composed_images_serve_a_job():
    done = subprocess.run(["scripts/container_check.sh"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1750)
    if done.returncode == 77:
        pytest.skip(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "container check passed" in done.stdout
