"""The GPU-faithful stand-in (the synthetic kind with prepare_ms and output_floats): CPU work
with the GIL held, the device's time with the GIL released, outputs packed as a real
embedding model's are."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import yaml

from config import load_models
from config.models import settings_digest
from scripts.stack import ROOT
from tasks import results
from workers.child.handlers.tensor import SyntheticHandler
from workers.spawn import FOLDER_VARIABLE


def standin(tmp_path: Path, **keys) -> SyntheticHandler:
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump({"models": {"s": {"kind": "synthetic", **keys}}}))
    handler = SyntheticHandler(load_models(path)["s"], "cpu")
    handler.initialize()
    return handler


def ticks_while(call) -> int:
    """How often a sibling thread, which needs the GIL to count, counted while `call` ran."""
    ticks, stop, started = [], threading.Event(), threading.Event()

    def sibling() -> None:
        started.set()
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)  # releases the GIL; counting again needs it back

    thread = threading.Thread(target=sibling)
    thread.start()
    started.wait(5)
    before = len(ticks)
    call()
    counted = len(ticks) - before
    stop.set()
    thread.join(5)
    return counted


def test_preparation_holds_the_gil_and_the_device_time_releases_it(tmp_path):
    handler = standin(tmp_path, prepare_ms=4, base_ms=80, per_item_ms=0)
    items = ["abc"] * 20  # 80 ms of preparation, then 80 ms of "device"
    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)  # a thread holding the GIL keeps it: no forced switch
    try:
        while_preparing = ticks_while(lambda: handler.preprocess(items))
        while_on_device = ticks_while(lambda: handler.inference(items))
    finally:
        sys.setswitchinterval(old)
    assert while_preparing <= 1, while_preparing
    assert while_on_device >= 5, while_on_device


def test_outputs_are_float32_vectors_packed_as_an_embedding_models(tmp_path):
    handler = standin(tmp_path, base_ms=0, per_item_ms=0, output_floats=384)
    outputs = handler.call(["ab", "abcd"])
    assert [len(row) for row in outputs] == [384, 384]
    stored = results.stored("job", outputs=outputs)
    assert len(stored) > 2 * 384 * 4 and stored.startswith(b"\x00")  # packed, not JSON
    first, second = results.unpack(stored)
    assert first.dtype == np.float32 and first[0] == 2.0 and second[1] == 2.0


def test_without_its_keys_the_synthetic_model_is_as_before(tmp_path):
    handler = standin(tmp_path, base_ms=0, per_item_ms=0)
    assert handler.call(["ab", "abcd"]) == [2, 4]
    assert not handler.spec.kind_settings  # so its version is the one it had
    plain = load_models(_write(tmp_path, {"kind": "synthetic"}))["s"]
    assert settings_digest(plain) == settings_digest(handler.spec.__class__(
        **{**plain.__dict__}))


def _write(tmp_path: Path, model: dict) -> Path:
    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump({"models": {"s": model}}))
    return path


def test_children_of_one_worker_take_turns_on_the_stand_ins_device(tmp_path, monkeypatch):
    """Two handlers of one worker on one device (threads here, children there: the lock is a
    file's, in the worker's own folder) run their device time one after the other, as calls
    on one GPU do; each one's device span is its own sleep, not its wait for the other."""
    monkeypatch.setenv(FOLDER_VARIABLE, str(tmp_path))
    first, second = (standin(tmp_path, base_ms=150, per_item_ms=0, output_floats=1)
                     for _ in range(2))
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda h: h.inference(["a"]), (first, second)))
    spans = sorted([first.device_span, second.device_span])
    assert spans[1][0] >= spans[0][1] - 0.001  # no overlap
    assert all(0.14 <= end - start < 0.3 for start, end in spans), spans


def test_the_plain_synthetic_models_children_run_side_by_side(tmp_path):
    first, second = (standin(tmp_path, base_ms=150, per_item_ms=0) for _ in range(2))
    started = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda h: h.inference(["a"]), (first, second)))
    assert time.monotonic() - started < 0.29


def test_the_device_lock_is_never_opened_through_a_link_nor_for_writing(tmp_path):
    """The outside attack of session 13: the lock's name is a guessable one in the shared
    temporary folder, and a root worker opened it for appending, so a link planted there had
    it create (and could have had it write) the link's target."""
    handler = standin(tmp_path, base_ms=1, per_item_ms=0, output_floats=1)
    target, handler.device_lock = tmp_path / "target", tmp_path / "planted.lock"
    handler.device_lock.symlink_to(target)
    with pytest.raises(OSError):  # refused: the stand-in's call fails rather than follow it
        handler.inference(["a"])
    assert not target.exists()
    handler.device_lock = tmp_path / "own.lock"
    handler.inference(["a"])
    assert (handler.device_lock.stat().st_mode & 0o222) == 0o200  # only its owner could write


def test_a_workers_lock_is_in_its_own_folder_which_goes_with_it(tmp_path):
    """The outside attack of session 13: a lock a worker, named after its pid, was left in
    the shared temporary folder after every worker's exit. In a worker (its main process made
    its own folder: workers/spawn.py), the lock is there, and the folder goes at its exit."""
    (tmp_path / "models.yaml").write_text(yaml.safe_dump({"models": {"s": {
        "kind": "synthetic", "base_ms": 0, "per_item_ms": 0, "output_floats": 1}}}))
    script = f"""
from config import load_models
from workers.child.handlers.tensor import SyntheticHandler
from workers.spawn import make_own_folder, own_folder
make_own_folder()
handler = SyntheticHandler(load_models({str(tmp_path / "models.yaml")!r})["s"], "cpu")
handler.inference(["a"])
print(own_folder(), oct(own_folder().stat().st_mode & 0o777), handler.device_lock,
      handler.device_lock.exists())
"""
    ran = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    folder, mode, lock, existed = ran.stdout.split()
    assert mode == "0o700" and Path(lock).parent == Path(folder) and existed == "True"
    assert not Path(folder).exists()


def test_a_stand_in_alone_takes_no_lock(tmp_path):
    """The outside attack of session 14: outside a worker (the calibrator loads a model
    alone), the lock was a guessable name in /tmp that another user could hold, blocking the
    calibrator, and that stayed behind. One process alone has no one to take turns with."""
    handler = standin(tmp_path, base_ms=1, per_item_ms=0, output_floats=1)
    assert handler.device_lock is None
    handler.inference(["a"])
