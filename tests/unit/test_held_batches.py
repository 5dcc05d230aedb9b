"""The pool's count of the batches each child holds (workers/broker/pool.py HeldBatches), which
Celery's fair scheduling reads as its busy children: an idle child is written first, and a busy
one is written its next batch while it runs one, up to `depth`."""
from __future__ import annotations

import pytest

from config import ConfigError, load_settings
from workers.broker.pool import HeldBatches, Pool


def test_an_idle_child_first_then_one_batch_ahead_per_child():
    held = HeldBatches({1, 2})
    held.depth = 2
    assert 1 not in held and len(held) == 0
    held.add(1)
    assert 1 in held and 2 not in held  # child 2 holds none: it is written first
    held.add(2)
    assert 1 not in held and 2 not in held and len(held) == 0  # each may take one ahead
    held.add(1)
    assert 1 in held and 2 not in held and len(held) == 1
    held.release(2)  # child 2's batch returned: it holds none, child 1 counts busy
    assert 1 in held and 2 not in held
    held.release(1)
    assert held.held == {1: 1}
    assert held.holding() == {1}


def test_depth_1_is_celerys_one_batch_a_child():
    held = HeldBatches({1, 2})
    held.add(1)
    held.add(2)
    assert 1 in held and 2 in held and len(held) == 2


def test_a_child_gone_holds_nothing():
    inqueues = {1, 2}
    held = HeldBatches(inqueues)
    held.depth = 2
    held.add(1)
    held.add(1)
    held.discard(1)  # its process down: the batch it held ahead goes back to the pool
    assert held.held == {} and 1 not in held
    held.add(2)
    inqueues.discard(1)  # no longer written to: not counted as an idle child
    assert 2 not in held  # the only child written to, holding one of two
    held.intersection_update({1})
    assert held.held == {}


def test_the_pool_counts_its_childrens_batches(monkeypatch):
    """Pool puts its HeldBatches where Celery's handlers read the busy set and mark a child
    free (`_busy_workers`, `_mark_worker_as_available`), before they are made."""
    from celery.concurrency.asynpool import AsynPool

    def fake_init(self, *args, **kwargs):
        self._all_inqueues = set()
        self._busy_workers = set()
        self._mark_worker_as_available = self._busy_workers.discard

    monkeypatch.setattr(AsynPool, "__init__", fake_init)
    pool = Pool()
    assert isinstance(pool._busy_workers, HeldBatches)
    assert pool._busy_workers.inqueues is pool._all_inqueues
    pool._all_inqueues.add(7)
    pool._busy_workers.add(7)
    pool.on_job_ready(None, 0, None, 7)  # Celery's handler of a returned job
    assert pool._busy_workers.held == {}


@pytest.mark.parametrize("value", [-1, 5])
def test_batches_ahead_out_of_bounds_is_refused_naming_it(value):
    with pytest.raises(ConfigError, match=f"batches_ahead must be an integer from 0 to 4, "
                                          f"got {value}"):
        load_settings({"batches_ahead": value})
