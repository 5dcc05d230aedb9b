"""Issue 29: a worker whose only pool child was killed gives the jobs it buffered back to their
queue at once, and fetches nothing while the replacement loads its models, so that another
worker on the queue serves them; the killed batch's jobs stay with it, to run alone. Two
workers on one queue, default settings; the replacement is held loading (`load_gate`) for as
long as the test needs, so that "before the replacement is ready" is a fact, not a race."""
from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

from scripts.stack import Stack, launch, wait_until
from tasks.jobstate import JobRecord
from tests.support.load import runs
from tests.support.records import fields_of

TERMINAL = ("succeeded", "failed", "cancelled", "expired")
# A batch of at most two one-input jobs takes 3 s: each worker's one child holds a batch and
# its main process buffers the rest of its prefetch (twice the batch size) meanwhile.
BATCH_S = 3.0


def models(log, gate) -> dict:
    return {"held": {"kind": "synthetic", "base_ms": BATCH_S * 1000, "per_item_ms": 0,
                     "max_batch_size": 2, "max_inputs": 1, "runs_log": str(log),
                     "load_gate": str(gate)}}


def post_all(stack: Stack, inputs: list[str]) -> dict[str, str]:
    """job id -> its one input, posted from 8 threads at once."""
    with ThreadPoolExecutor(8) as pool:
        return dict(pool.map(lambda text: (stack.submit("held", [text])["id"], text), inputs))


def records(stack: Stack, job_ids) -> dict[str, dict]:
    return fields_of(stack.redis, list(job_ids))


def finals(stack: Stack, job_ids) -> dict[str, JobRecord]:
    """The records read as the API reads them (a succeeded one is kept compact)."""
    return {j: JobRecord.from_fields(j, r) for j, r in records(stack, job_ids).items()}


def held_by(stack: Stack, node: str) -> set[str]:
    """The delivery tags on the in-flight records of worker `node` (buffered or running)."""
    client = stack.redis
    return {tag for inc in client.hkeys("iq:fetchers") if inc.startswith(f"{node}@")
            for tag in client.hkeys(f"iq:inflight:{inc}")}


def tag_of(record: dict) -> str:
    return json.loads(record["message"])["properties"]["delivery_tag"]


def holding(stack: Stack, job_ids) -> tuple[int, set[str], set[str]] | None:
    """Worker a's child, while it runs a full batch (two jobs) that started under a second ago
    and a's main process buffers other jobs: (child's pid, the batch's jobs, the buffered
    jobs)."""
    held, recs = held_by(stack, "a"), records(stack, job_ids)
    now_ms = time.time() * 1000
    running = {j: r for j, r in recs.items()
               if r.get("status") == "running" and r["worker"].startswith("a@")}
    buffered = {j for j, r in recs.items() if r.get("status") == "queued" and tag_of(r) in held}
    if len(running) < 2 or not buffered or \
            any(now_ms - int(r["started_at"]) > 1000 for r in running.values()):
        return None
    pids = {int(r["worker"].rsplit("/", 1)[1]) for r in running.values()}
    assert len(pids) == 1, f"worker a runs one child: {pids}"
    return pids.pop(), set(running), buffered


def b_done(stack: Stack, job_ids) -> bool:
    """Whether each of these jobs finished, or waits with worker a (its record keeps the
    message until it finishes)."""
    held = held_by(stack, "a")
    return all(r.get("status") in TERMINAL or tag_of(r) in held
               for r in records(stack, job_ids).values())


def ready_lines(stack: Stack, node: str) -> int:
    """How many times worker `node`'s children said a model was loaded (runtime.py's line)."""
    return stack.workers[node].log.read_text(errors="replace").count(" ready on ")


def test_a_killed_childs_buffered_jobs_are_served_by_the_other_worker_meanwhile(tmp_path):
    log, gate = tmp_path / "runs.log", tmp_path / "load-gate"
    stack = launch(tmp_path, models(log, gate), {"a": ["held"], "b": ["held"]}, defaults=True)
    try:
        # Both workers' children loaded (launch waits for one of them) before the gate.
        wait_until(lambda: ready_lines(stack, "a") and ready_lines(stack, "b"), 60,
                   "both workers' children loaded")
        loaded = ready_lines(stack, "a")
        first = post_all(stack, [f"first-{i}" for i in range(16)])
        gate.touch()  # from now on a child that loads the model waits: a's replacement will
        pid, batch, buffered = wait_until(lambda: holding(stack, first), 60,
                                          "worker a running a batch with jobs buffered")
        os.kill(pid, signal.SIGKILL)
        # What had not run by the kill (a's buffered jobs among them; its child is gone, so
        # none of it can finish on a after this read), and jobs that arrive while a's
        # replacement loads.
        unfinished = {j for j, r in records(stack, first).items()
                      if r.get("status") not in TERMINAL} - batch
        second = post_all(stack, [f"second-{i}" for i in range(4)])
        others = unfinished | set(second)
        assert buffered <= others

        # Until every job a does not hold has finished: b is done with what it can run.
        wait_until(lambda: b_done(stack, others), 90, "b done with the jobs a does not hold")
        ran_on = {j: (r.status.value, (r.worker or "").split("@")[0])
                  for j, r in finals(stack, others).items()}
        assert ready_lines(stack, "a") == loaded and gate.exists()  # still loading
        assert ran_on == {j: ("succeeded", "b") for j in others}, \
            "a's buffered jobs and those that came after the kill ran on b meanwhile"
        assert held_by(stack, "a") == {tag_of(r) for r in records(stack, batch).values()}, \
            "a holds the killed batch's jobs only: it fetched nothing while its child loads"

        gate.unlink()
        wait_until(lambda: all(r.get("status") in TERMINAL for r in
                               records(stack, batch).values()), 90, "the killed batch's jobs")
        final = finals(stack, set(first) | set(second))
        assert {j: r.status.value for j, r in final.items()} == \
            {j: "succeeded" for j in final}, "no job lost or failed"
        for j in batch:  # on a's replacement, each alone, as a lost batch's jobs run
            node, pid_after = final[j].worker.split("@")[0], final[j].worker.rsplit("/")[-1]
            assert node == "a" and int(pid_after) != pid, final[j].worker
        assert len({final[j].batch["id"] for j in batch}) == len(batch), "each alone"
        assert {j: r.runs for j, r in final.items()} == \
            {j: 2 if j in batch else 1 for j in final}, "started twice: the killed batch only"
        ran = runs(log)
        assert {t: ran[t] for t in {**first, **second}.values()} == \
            {t: 1 for t in {**first, **second}.values()}, "each job's model call finished once"
    finally:
        gate.unlink(missing_ok=True)
        stack.stop()
