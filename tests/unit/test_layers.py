"""The layers hold by a check, not by care: import-linter's contracts in .importlinter
(config imports nothing of the project; tasks/ never imports app/ or workers/; app/ and
workers/ never import each other; web/, the API's gunicorn worker, imports of the service
config/ at most, nothing of the app's libraries, and neither it nor app/ imports the other;
app/, web/, tasks/ and config/ never import torch, transformers or matplotlib; nothing in
production or bench/ imports tests/; no import cycles; workers/ in rooms: main above batching/
above child/ and broker/, which never import each other; the webhook deliverer never imports
the worker's entry module, its child or torch)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from scripts.stack import ROOT


def test_import_contracts_are_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    env = dict(os.environ, PYTHONPATH="client")  # the client package, as pytest.ini has it
    done = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout, done.stdout
