"""children_per_gpu: how many pool children a worker runs per GPU, what a device's children
may each allocate, and which device each child takes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from config import ConfigError, load_settings
from config.models import ModelSpec
from scripts.stack import ROOT
from workers.child.devices import child_memory_fraction, pool_children


def test_a_worker_runs_children_per_gpu_children_per_gpu_and_none_extra_without_one():
    assert pool_children(load_settings({"gpu_count": 2})) == 2
    assert pool_children(load_settings({"gpu_count": 2, "children_per_gpu": 2})) == 4
    assert pool_children(load_settings({"gpu_count": 0, "children_per_gpu": 2})) == 0


@pytest.mark.parametrize("value", [0, 9, -1])
def test_a_count_out_of_bounds_is_refused_naming_it(value):
    with pytest.raises(ConfigError, match=f"children_per_gpu must be an integer from 1 to 8, "
                                          f"got {value}"):
        load_settings({"children_per_gpu": value})


def test_a_devices_children_share_its_memory_cap():
    one = load_settings({"cuda_memory_fraction": 0.8})
    two = load_settings({"cuda_memory_fraction": 0.8, "children_per_gpu": 2})
    assert child_memory_fraction(0.0, one) == 0.8
    assert child_memory_fraction(0.0, two) == pytest.approx(0.4)
    assert child_memory_fraction(0.5, two) == pytest.approx(0.25)  # the models' own
    assert child_memory_fraction(0.0, load_settings({"children_per_gpu": 2})) == 0.0


def test_worker_sh_starts_children_per_gpu_children_per_gpu():
    """The count scripts/worker.sh takes for its --concurrency."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IQ_")}
    out = subprocess.run([sys.executable, "-m", "workers.child.devices"], cwd=ROOT, text=True,
                         env=dict(env, IQ_GPU_COUNT="3", IQ_CHILDREN_PER_GPU="2"),
                         capture_output=True, check=True).stdout
    assert out.strip() == "6"


@pytest.fixture
def two_gpus(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.mark.parametrize("driver", [False, True])
def test_children_take_devices_in_turn_and_the_stand_in_asks_torch_only_where_a_driver_is(
        two_gpus, monkeypatch, tmp_path, driver):
    """torch (here made to see two GPUs) places a torch model; the stand-in, which runs no
    torch, is placed by torch where a GPU driver shows itself, else on the CPU unasked."""
    from workers.child import devices

    shown = tmp_path / "nvidia"
    if driver:
        shown.mkdir()
    monkeypatch.setattr(devices, "GPU_DRIVERS", (str(shown),))
    assert [devices.pick_device("auto", i) for i in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]
    assert devices.pick_device("cpu", 1) == "cpu"
    stand_in = devices.pick_device("auto", 3, runs_torch=False)
    assert stand_in == ("cuda:1" if driver else "cpu")
    if not driver:
        with pytest.raises(ConfigError, match="device: cuda was asked for but no CUDA device"):
            devices.pick_device("cuda", 0, runs_torch=False)
        # As a child says it: the model and its field named (the outside attack of session 13
        # got the first half alone, in a worker's crash loop).
        spec = ModelSpec("syn", "synthetic", "syn", device="cuda")
        with pytest.raises(ConfigError, match=r"^models\.syn\.device: 'cuda': device: cuda "):
            devices.device_for(spec, 0, runs_torch=False)
