"""The processes that must never touch CUDA never even import torch: the API, the worker's
parent (which buffers and dispatches; models live in the pool children) and the webhook
deliverer."""
from __future__ import annotations

import subprocess
import sys

import pytest

from scripts.stack import ROOT


@pytest.mark.parametrize("code", [
    "from app import create_app; create_app()",
    "import workers.main",
    "import os; os.environ['IQ_WEBHOOK_SECRET'] = 's3cret'; import deliverer.main",
])
def test_module_does_not_import_torch(code):
    check = f"import sys; {code}; assert 'torch' not in sys.modules, 'torch imported'"
    out = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
