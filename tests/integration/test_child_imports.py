"""What a pool child imports: the stand-in (kind synthetic) runs no torch, so a child that loads
only stand-ins (the session stack's `synth` worker) never imports it, through its start, a
batch and a failed job; a child that loads torch models (the `text` worker) does
(docs/models.md: a child of stand-ins starts on ~1 s of CPU, not ~2.7 s)."""
from __future__ import annotations

from pathlib import Path

import psutil

from tests.support.workers import pool_children
from workers.child.handlers.tensor import FAIL_MARKER


def torch_mapped(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_a_child_of_stand_ins_only_never_imports_torch(stack):
    ran = stack.submit("synthetic", ["a", "bb"])
    failed = stack.submit("synthetic", [FAIL_MARKER])  # a model's error: is it out of memory?
    assert stack.finished(ran["id"])["status"] == "succeeded"
    assert stack.finished(failed["id"])["status"] == "failed"
    synth = pool_children(psutil.Process(stack.workers["synth"].proc.pid))
    text = pool_children(psutil.Process(stack.workers["text"].proc.pid))
    assert synth and not any(torch_mapped(child.pid) for child in synth), synth
    assert text and all(torch_mapped(child.pid) for child in text), text
