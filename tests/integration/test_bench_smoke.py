"""The benchmark harness works end to end (quick variant). It asserts no speed."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.support.services import ROOT


def test_quick_benchmark_writes_results_and_plot(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "quick.json").read_text())
    synthetic = report["models"]["synthetic"]
    assert [r["batch_size"] for r in synthetic["raw"]["batches"]] == [1, 2, 4, 8, 16, 32]
    assert set(synthetic["configs"]) == {"service", "no-batching", "celery-batches"}
    for name, config in synthetic["configs"].items():
        assert [p["clients"] for p in config["sweep"]] == [1, 4], name
        for point in config["sweep"] + [config["multi"]]:
            assert point["jobs"] > 0 and point["errors"] == 0, (name, point)
            assert point["items_per_s"] > 0 and point["p99_ms"] >= point["p50_ms"] > 0
    assert (tmp_path / "quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
