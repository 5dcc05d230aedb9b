"""How the jobs a load test submitted ended, read from their records: waited for until each is
final, then checked to have succeeded and run exactly once (the record's `runs`)."""
from __future__ import annotations

from scripts.processes import wait_until
from tests.support.load import TERMINAL
from tests.support.records import fields_of


def settle(stack, job_ids: list[str], timeout: float = 180) -> dict[str, dict[str, str]]:
    """Every job's record once each is final (or the last reading, after `timeout`: the
    checks that follow say which are not)."""
    records: dict[str, dict[str, str]] = {}

    def final() -> bool:
        records.update(fields_of(stack.redis, job_ids))
        return all(records[j].get("status") in TERMINAL for j in job_ids)

    try:
        wait_until(final, timeout, "every accepted job final", interval=1.0)
    except TimeoutError:
        pass
    return records


def assert_each_succeeded_once(records: dict[str, dict[str, str]]) -> None:
    stuck = {j: r.get("status") for j, r in records.items() if r.get("status") != "succeeded"}
    errors = sorted({r.get("error", "") for r in records.values() if r.get("error")})
    twice = {j: r.get("runs") for j, r in records.items() if r.get("runs") != "1"}
    assert not stuck, f"{len(stuck)} of {len(records)} jobs not succeeded: " \
                      f"{sorted(set(map(str, stuck.values())))} {errors[:3]}"
    assert not twice, f"{len(twice)} jobs did not run exactly once: {twice}"
