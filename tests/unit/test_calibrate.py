"""The batch-size calibrator on the CPU: the command end to end on a model that runs out of
memory above 20 items, where its plot goes, the stopping rule on one whose items/s levels off,
and the warning when its timings are too noisy to trust."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from config.models import ModelSpec
from scripts.stack import ROOT
from scripts.calibrate import NOISY, RESULTS, calibrate, noise_warning
from workers.child.handlers.tensor import SyntheticHandler


def test_the_command_stops_at_out_of_memory_and_recommends_80_percent(tmp_path):
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": {"oomy": {
        "kind": "synthetic", "base_ms": 20, "per_item_ms": 0, "oom_above": 20,
        "max_batch_size": 4}}}))
    # 20 ms a batch of any size: each doubling doubles items/s, which no neighbour's CPU
    # undoes (at 1 ms a batch, a loaded machine once made batch 2 slower than batch 1, and the
    # run stopped there, short of the out-of-memory this checks).
    plot = tmp_path / "oomy.png"
    out = subprocess.run([sys.executable, "-m", "scripts.calibrate", "oomy", "--models-file",
                          str(models), "--plot", str(plot)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "stopped: out of memory at 32; largest safe batch: 16" in out.stdout
    assert "max_batch_size: 12" in out.stdout  # 80% of 16
    assert "max_wait_ms:" in out.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.serial  # it times sleeps of a few ms: a busy neighbour stretches them
def test_it_stops_when_doubling_no_longer_pays():
    # n items cost 4 + 0.25·n ms: items/s levels off towards 4000.
    spec = ModelSpec(name="flat", kind="synthetic", queue="flat", base_ms=4, per_item_ms=0.25)
    handler = SyntheticHandler(spec, "cpu")
    result = calibrate(handler, limit=4096, min_gain=0.05, repeats=2)
    rates = [s.items_per_s for s in result.steps]
    assert not any(s.oom for s in result.steps)
    assert "grew less than 5%" in result.stopped
    assert rates[-1] < 1.05 * max(rates[:-1])           # the step that stopped it
    assert all(b >= 1.05 * max(rates[:i + 1]) for i, b in enumerate(rates[1:-1]))
    assert 16 <= result.largest_safe < 4096
    assert result.max_batch_size == int(0.8 * result.largest_safe)
    assert result.max_wait_ms >= 4  # a call of one item costs at least its 4 ms


def test_the_plot_goes_under_bench_results_not_where_it_is_run(tmp_path):
    name = f"plotted-{uuid.uuid4().hex[:8]}"
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": {name: {
        "kind": "synthetic", "base_ms": 1, "per_item_ms": 0, "oom_above": 2}}}))
    plot = RESULTS / f"calibration-{name}.png"
    try:
        out = subprocess.run([sys.executable, "-m", "scripts.calibrate", name,
                              "--models-file", str(models)], cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": str(ROOT)},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"plot: {plot}" in out.stdout
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert list(tmp_path.glob("*.png")) == []  # nothing where it was run
    finally:
        plot.unlink(missing_ok=True)
    ignored = subprocess.run(["git", "check-ignore", "-q", str(plot)], cwd=ROOT)
    assert ignored.returncode == 0  # a machine's plot is not the repository's


class Disturbed(SyntheticHandler):
    """Every other call takes 30 ms more, as when another process takes the CPU."""

    calls = 0

    def inference(self, batch):
        Disturbed.calls += 1
        if Disturbed.calls % 2:
            time.sleep(0.03)
        return super().inference(batch)


def test_timings_too_noisy_to_trust_are_said():
    spec = ModelSpec(name="noisy", kind="synthetic", queue="noisy", base_ms=1, per_item_ms=0,
                     oom_above=4)
    result = calibrate(Disturbed(spec, "cpu"), limit=4, repeats=3)
    assert result.noisy and all(s.spread > NOISY for s in result.noisy)
    warning = noise_warning(result)
    assert warning.startswith("warning: the timings are too noisy to trust")
    assert "idle machine" in warning and "of 3 calls" in warning
