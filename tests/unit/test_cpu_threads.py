"""A model on the CPU leaves one core to the processes beside it (workers/devices.py): the
rule, and what a pool child's torch is then set to."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from config import Settings
from scripts.stack import ROOT
from workers.devices import cpu_threads, usable_cpus


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 1), (4, 3), (16, 15)])
def test_by_default_a_cpu_model_takes_every_usable_core_but_one(cpus, threads):
    assert cpu_threads(Settings(), cpus) == threads


def test_iq_cpu_threads_overrides_the_rule():
    assert cpu_threads(Settings(cpu_threads=2), 16) == 2
    assert cpu_threads(Settings(cpu_threads=8), 2) == 8


def test_usable_cpus_follow_the_affinity():
    assert usable_cpus() == len(os.sched_getaffinity(0))


def _threads_after_prepare(device: str, environ: dict[str, str], cores: str) -> int:
    """torch's thread count after prepare_device, in a process pinned to `cores` (taskset)."""
    code = ("from config import load_settings; from workers.devices import prepare_device; "
            f"prepare_device({device!r}, load_settings()); import torch; "
            "print(torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if not k.startswith("IQ_")} | environ
    out = subprocess.run(["taskset", "-c", cores, sys.executable, "-c", code], cwd=ROOT,
                         env=env, capture_output=True, text=True, check=True, timeout=120)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to")
def test_a_pool_childs_torch_on_the_cpu_is_set_to_the_rule():
    # Pinned to two cores, torch's own default would be 2 threads; the rule gives 1.
    assert _threads_after_prepare("cpu", {}, "0,1") == 1
    assert _threads_after_prepare("cpu", {"IQ_CPU_THREADS": "2"}, "0,1") == 2
