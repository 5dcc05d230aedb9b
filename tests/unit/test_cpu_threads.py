"""IQ_CPU_THREADS sets a pool child's torch threads; unset, torch keeps its default (every
core): fewer cost throughput on this machine (bench/README, "torch threads on the CPU")."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scripts.stack import ROOT
from workers.child.devices import cores_less_one, usable_cpus


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 1), (4, 3), (16, 15)])
def test_cores_less_one_leaves_one_core_but_never_takes_the_last(cpus, threads):
    assert cores_less_one(cpus) == threads


def test_usable_cpus_follow_the_affinity():
    assert usable_cpus() == len(os.sched_getaffinity(0))


def _threads_after_prepare(device: str, environ: dict[str, str], cores: str) -> int:
    """torch's thread count after prepare_device, in a process pinned to `cores` (taskset)."""
    code = ("from config import load_settings; from workers.child.devices import prepare_device; "
            f"prepare_device({device!r}, load_settings()); import torch; "
            "print(torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if not k.startswith("IQ_")} | environ
    out = subprocess.run(["taskset", "-c", cores, sys.executable, "-c", code], cwd=ROOT,
                         env=env, capture_output=True, text=True, check=True, timeout=120)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to")
def test_a_pool_childs_torch_threads_follow_iq_cpu_threads():
    assert _threads_after_prepare("cpu", {"IQ_CPU_THREADS": "1"}, "0,1") == 1
    # Unset: torch's own default, every core it may run on.
    assert _threads_after_prepare("cpu", {}, "0,1") == 2
