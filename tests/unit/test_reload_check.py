"""`make reload`'s check of a new models file (scripts/reload.py `install`): a model file a
pool child could not open must be refused before anything changes. A reload replaces every
worker's children, and a child that cannot load its models stopped its worker, so a garbage
weights file that passed the check stopped every worker while the reload said "done"."""
from __future__ import annotations

import fcntl
import os
import zipfile

import pytest
import yaml

from scripts.reload import Invalid, install

GOOD = {"quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0}}


def models_file(tmp_path, models: dict):
    target = tmp_path / "models.yaml"
    target.write_text(yaml.safe_dump({"models": GOOD}))
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump({"models": models}))
    return target, new


@pytest.mark.parametrize("make", ["garbage", "empty", "folder"])
def test_a_tensor_model_file_that_is_no_archive_is_refused_and_nothing_changes(tmp_path, make):
    weights = tmp_path / "bad.pt"
    if make == "garbage":
        weights.write_bytes(b"not a TorchScript archive")
    elif make == "empty":
        weights.write_bytes(b"")
    else:
        weights.mkdir()
    target, new = models_file(tmp_path, {**GOOD, "ts": {"kind": "torchscript",
                                                         "path": str(weights),
                                                         "input_shape": [1]}})
    before = target.read_bytes()
    with pytest.raises(Invalid, match=r"models\.ts: .*bad\.pt"):
        install(target, new)
    assert target.read_bytes() == before
    assert not (tmp_path / "models.yaml.previous").exists()


def test_a_tensor_model_file_that_is_an_archive_passes(tmp_path):
    weights = tmp_path / "good.pt"
    with zipfile.ZipFile(weights, "w") as archive:
        archive.writestr("good/data.pkl", b"")
    target, new = models_file(tmp_path, {**GOOD, "ts": {"kind": "torchscript",
                                                         "path": str(weights),
                                                         "input_shape": [1]}})
    assert install(target, new)
    assert "ts" in yaml.safe_load(target.read_text())["models"]


def reload_while_another_runs(target, new):
    """`make reload FILE=new` while a first reload, still waiting for the processes, holds the
    lock beside the models file: its result and what it said."""
    from config import Settings
    from scripts.reload import reload

    said: list[str] = []
    held = os.open(target.with_name(".models.yaml.reload-lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        result = reload(new, say=said.append, timeout_s=1,
                        settings=Settings(models_file=str(target),
                                          redis_url="redis://127.0.0.1:1/0"))
    finally:
        os.close(held)
    return result, said


def test_a_second_reload_while_one_runs_is_refused_and_changes_nothing(tmp_path):
    from scripts.reload import INVALID

    target, new = models_file(tmp_path, {"quick": {**GOOD["quick"], "version": "2"}})
    before = target.read_bytes()
    result, said = reload_while_another_runs(target, new)
    assert result.status == INVALID, said
    assert "another reload" in said[0] and "nothing changed" in said[0]
    assert target.read_bytes() == before
    assert not (tmp_path / "models.yaml.previous").exists()


@pytest.mark.parametrize("bad", [{"quick": {**GOOD["quick"], "max_bacth_size": 4}},
                                 {"quick": {**GOOD["quick"], "redis": "gpu"}}],
                         ids=["typo", "unknown-group"])
def test_a_bad_file_is_refused_for_itself_while_another_reload_runs(tmp_path, bad):
    """A file that is wrong by itself is refused naming its field before the reload lock is
    taken: so it neither waits behind a running reload nor holds up a good one started beside
    it (the attack on issue 37: a bad and a good reload racing were both refused)."""
    from scripts.reload import INVALID

    target, new = models_file(tmp_path, bad)
    before = target.read_bytes()
    result, said = reload_while_another_runs(target, new)
    assert result.status == INVALID, said
    assert said[0].startswith("reload refused, nothing changed: models.quick"), said
    assert "another reload" not in said[0]
    assert target.read_bytes() == before
    assert not (tmp_path / "models.yaml.previous").exists()


CUDA = {"quick": {"kind": "synthetic", "device": "cuda"}}


def test_a_cuda_model_is_refused_against_a_host_without_gpus(tmp_path):
    """No worker reports (all down, or held by their keeper): the file is checked against this
    host's GPUs (nvidia-smi's count), and a `device: cuda` model refused, nothing changed."""
    target, new = models_file(tmp_path, CUDA)
    before = target.read_bytes()
    with pytest.raises(Invalid, match=r"^models\.quick\.device: 'cuda', but this host has no "
                                      r"GPU \(nvidia-smi lists none\)"):
        install(target, new, host_gpus=0)
    assert target.read_bytes() == before
    install(target, new, host_gpus=1)  # a host with one: installed
    assert yaml.safe_load(target.read_text())["models"] == CUDA


def test_the_keeper_and_make_run_check_devices_against_this_host(tmp_path):
    """make run (scripts/run.py) stops before anything starts, and the worker's keeper
    (scripts/respawn.py) holds it, on a `device: cuda` model where the host has no GPU; the
    API's keeper does not (the API loads no model)."""
    from config import load_settings
    from scripts.respawn import config_problem
    from scripts.run import _models_problems

    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": CUDA}))
    os.chmod(models, 0o600)
    env = {"IQ_MODELS_FILE": str(models), "IQ_GPU_COUNT": "0"}
    line = "models.quick.device: 'cuda', but this host has no GPU (nvidia-smi lists none): " \
           "its worker's children could not load it"
    assert config_problem(env, devices=True) == line
    assert config_problem(env) == ""
    assert _models_problems(load_settings(environ=env)) == [f"make run: {line}"]
    assert config_problem(dict(env, IQ_GPU_COUNT="1"), devices=True) == ""


def test_a_model_moved_where_no_worker_consumes_its_queue_is_refused(tmp_path):
    """By the workers' reports on each Redis (group): a model moved to a group where no
    worker runs, or to a queue no worker there consumes, is refused; a model no worker
    consumed before the reload (parked on purpose) is no reason to refuse another change."""
    from scripts.reload import consumers_problems

    parked = {"kind": "synthetic", "queue": "parked"}
    target, _ = models_file(tmp_path, {})
    target.write_text(yaml.safe_dump({"models": {**GOOD, "parked": parked}}))
    workers = {"": {"worker:a@h": {"queues": ["quick"], "consumes_all": False}},
               "spare": {}, "b": {"worker:b@h": {"queues": ["other"]}}}

    def check(models: dict) -> list[str]:
        new = tmp_path / "next.yaml"
        new.write_text(yaml.safe_dump({"models": models}))
        return consumers_problems(target, new, workers)

    quick = GOOD["quick"]
    assert check({**GOOD, "parked": {**parked, "max_batch_size": 2}}) == []
    assert check({"quick": {**quick, "redis": "spare"}}) == [
        "models.quick.redis: no worker runs on group 'spare': its jobs would wait there for "
        "ever; start one there before a reload moves it"]
    assert check({"quick": {**quick, "redis": "b"}}) == [
        "models.quick.queue: no worker on group 'b' consumes queue 'quick': its jobs would "
        "wait there for ever; start one that does (its -Q) before a reload names it"]
    assert check({"quick": {**quick, "queue": "quick-q2"}}) == [
        "models.quick.queue: no worker on the default Redis consumes queue 'quick-q2': its "
        "jobs would wait there for ever; start one that does (its -Q) before a reload names it"]
    workers[""]["worker:a@h"]["consumes_all"] = True  # it takes up a new queue: served
    assert check({"quick": {**quick, "queue": "quick-q2"}}) == []
    # No worker reports at all (none runs, or none consumes yet): not passed for want of one
    # (make reload waits for one first: tests/integration/test_reload_timeout.py).
    assert consumers_problems(target, tmp_path / "next.yaml", {"": {}, "b": {}}) == [
        "models.quick.redis: no worker runs on the default Redis: its jobs would wait there "
        "for ever; start one there before a reload moves it"]


def test_an_undone_reload_keeps_previous_as_it_was_and_the_failed_file_beside_it(tmp_path):
    """After a failed reload's undo, `<name>.previous` is still the last good file before the
    one in place (README's rollback goes there), the failed file kept as `<name>.failed`."""
    from scripts.reload import REFUSED, Result, _undo
    from config import load_settings

    target = tmp_path / "models.yaml"
    earlier, good, bad = ({"models": {m: {"kind": "synthetic"}}} for m in ("e", "g", "b"))
    previous, failed = tmp_path / "models.yaml.previous", tmp_path / "models.yaml.failed"
    target.write_text(yaml.safe_dump(earlier))
    source = tmp_path / "good.yaml"
    source.write_text(yaml.safe_dump(good))
    install(target, source)  # the last good reload: previous holds `earlier`
    source.write_text(yaml.safe_dump(bad))
    kept = previous.read_bytes()
    install(target, source)  # the failed one (as reload() installs it), then undone
    said: list[str] = []
    _undo(target, Result(REFUSED, "x", failed_load=True), [], 5, said.append,
          load_settings({"models_file": str(target)}), kept)
    assert yaml.safe_load(target.read_text()) == good
    assert yaml.safe_load(previous.read_text()) == earlier
    assert yaml.safe_load(failed.read_text()) == bad
    assert f"the failed one is kept as {failed}" in said[0], said
