"""A record read back (`JobRecord.from_fields`, and a success as its finish announced it on a
reply channel, `announced_record`) is the record the release before read, field for field, for
every shape a record takes: each field present, empty or absent, compact (`r`, `t`, `w`, `v`:
tasks/lua/_compact.lua) or under its names, times as Unix milliseconds or ISO 8601, a batch as
words or JSON. Issue 40 made the read cheaper (~20 calls of `get` and a decode a field fewer a
job); these hold it to the same answer, and so the same bytes of a job's answer."""
from __future__ import annotations

import sys
from collections import Counter
from datetime import datetime, timedelta, timezone
from typing import Mapping

import pytest

from app.responses import job_body
from tasks.errors import JobError
from tasks.jobstate import JobRecord, Status, announced_record

# --- The read of the release before (tasks/jobstate.py at 6ac1269), verbatim but for names. ---
_SHORT = {"t": "trace_id", "w": "worker", "v": "model_version"}


def _time_before(text):
    if not text:
        return None
    if text.isdigit():
        ms = int(text)
        return datetime.fromtimestamp(ms // 1000, timezone.utc) + timedelta(
            milliseconds=ms % 1000)
    return datetime.fromisoformat(text)


def _batch_before(text):
    import orjson

    if not text:
        return None
    if text.startswith("{"):
        return orjson.loads(text)
    batch_id, jobs, items = text.split()
    return {"id": batch_id, "jobs": int(jobs), "items": int(items)}


def _record_fields_before(raw: Mapping[str, str]) -> Mapping[str, str]:
    if not any(name in raw for name in ("r", *_SHORT)):
        return raw
    out = {_SHORT.get(name, name): value for name, value in raw.items() if name != "r"}
    if raw.get("r"):
        started, finished, runs, inputs, batch = raw["r"].split(" ", 4)
        start_ms = int(raw["created_at"]) + int(started)
        out.update(started_at=str(start_ms), finished_at=str(start_ms + int(finished)),
                   runs=runs, inputs=inputs, batch=batch)
    return out


def from_fields_before(job_id, raw, outputs=None):
    get = _record_fields_before(raw).get
    return JobRecord(
        id=job_id, status=Status(raw["status"]), model=raw["model"],
        created_at=_time_before(raw["created_at"]),
        trace_id=get("trace_id", ""), inputs=int(get("inputs") or 0),
        priority=get("priority") or "normal", owner=get("owner", ""),
        encoding_format=get("encoding_format") or "float",
        webhook_url=get("webhook_url", ""), webhook_events=get("webhook_events", ""),
        token=get("token", ""),
        expires_at=float(get("expires_at")) if get("expires_at") else None,
        started_at=_time_before(get("started_at")), finished_at=_time_before(get("finished_at")),
        worker=get("worker"), batch=_batch_before(get("batch")),
        runs=int(get("runs") or 0), model_version=get("model_version", ""),
        error=JobError.from_json(raw["error"]) if get("error") else None,
        items_done=int(get("items_done") or 0), retry_of=get("retry_of") or "",
        retried_as=get("retried_as") or "", kept=int(get("kept") or 0), outputs=outputs)
# --- end of the release before's read. ---


ERROR = '{"code":"inference_error","message":"bad input \\u00e9"}'
# A succeeded record as FINISH writes it compact, in its order (tasks/lua/_compact.lua).
COMPACT = {"status": "succeeded", "token": "tok", "model": "minilm-embed",
           "created_at": "1796529361123", "r": "12 345 2 3 b-1 4 9", "t": "trace-1",
           "w": "w@h/0/77", "v": "v9", "priority": "high", "owner": "team-a",
           "encoding_format": "base64", "webhook_url": "https://hook.example/x",
           "webhook_events": "succeeded,failed", "items_done": "1", "retry_of": "j-0",
           "crashes": "1", "webhook_id": "d-1"}
# A record under its names (not final yet, of an earlier release, or one that did not succeed).
NAMED = {"status": "failed", "model": "minilm-embed", "created_at": "1796529361123",
         "trace_id": "trace-1", "inputs": "3", "priority": "low", "owner": "team-b",
         "encoding_format": "float", "webhook_url": "https://hook.example/y",
         "webhook_events": "failed", "token": "tok", "expires_at": "1796529400.5",
         "started_at": "1796529361200", "finished_at": "1796529361999", "worker": "w@h/1/2",
         "batch": "b-2 5 11", "runs": "2", "error": ERROR, "items_done": "2",
         "retry_of": "j-1", "retried_as": "j-2", "kept": "120", "model_version": "v8"}
OLD = {**NAMED, "created_at": "2026-12-05T12:00:00.123+00:00",
       "started_at": "2026-12-05T12:00:01.5+00:00", "finished_at": "2026-12-05T12:00:02+00:00",
       "batch": '{"id": "b-3", "jobs": 2, "items": 4}'}
REQUIRED = ("status", "model", "created_at")


def _spread() -> dict[str, dict[str, str]]:
    """Every base whole, bare (its required fields alone), and with each other field absent,
    empty or changed, one at a time."""
    shapes: dict[str, dict[str, str]] = {}
    for base_name, base in (("compact", COMPACT), ("named", NAMED), ("old", OLD)):
        shapes[base_name] = dict(base)
        shapes[f"{base_name}, bare"] = {k: base[k] for k in REQUIRED}
        for name in base:
            if name in REQUIRED:
                continue
            shapes[f"{base_name}, no {name}"] = {k: v for k, v in base.items() if k != name}
            shapes[f"{base_name}, {name} empty"] = {**base, name: ""}
    shapes["compact, other statuses"] = {**COMPACT, "status": "cancelled"}
    shapes["named, queued, never ran"] = {k: NAMED[k] for k in (*REQUIRED, "token", "inputs")}
    shapes["named, r and t as well"] = {**NAMED, "t": "other", "r": COMPACT["r"]}
    return shapes


SPREAD = _spread()


@pytest.mark.parametrize("shape", SPREAD)
def test_a_record_reads_as_the_release_before_read_it(shape):
    raw = SPREAD[shape]
    outputs = [[0.5, -1.0]] if raw["status"] == "succeeded" else None
    assert JobRecord.from_fields("j", raw, outputs) == from_fields_before("j", raw, outputs)


def _joined(raw: Mapping[str, str]) -> tuple[bytes, bytes, int]:
    """A success's entry on a reply channel, as FINISH joins it: names and values by NUL."""
    parts = [part for pair in raw.items() for part in pair]
    return "\0".join(parts).encode(), b"", len(parts)


@pytest.mark.parametrize("shape", [s for s in SPREAD if not s.startswith("old")])
@pytest.mark.parametrize("peers", [True, False])
def test_an_announced_success_answers_as_its_record_read(shape, peers):
    raw = SPREAD[shape]
    announced = announced_record("j", _joined(raw))
    # A field sent empty is one the record lacks, as a read finds it.
    read = from_fields_before("j", {k: v for k, v in raw.items() if v})
    assert announced == read
    assert job_body(announced, peers=peers) == job_body(read, peers=peers)


def test_an_announced_success_is_decoded_once_and_read_without_get():
    # One decode for the whole entry, not one a name and one a value; the record's fields read
    # by subscript over their defaults, not by ~20 calls of `get`.
    entry = _joined(COMPACT)
    calls: Counter[str] = Counter()

    def count(frame, event, arg):
        if event == "c_call":
            calls[arg.__name__] += 1

    sys.setprofile(count)
    try:
        record = announced_record("j", entry)
    finally:
        sys.setprofile(None)
    assert record == from_fields_before("j", COMPACT)
    assert calls["decode"] == 1
    assert calls["get"] == 0


def _iso_before(moment: datetime) -> str:
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


@pytest.mark.parametrize("moment", [
    datetime(2026, 12, 5, 12, 0, 0, 123000, tzinfo=timezone.utc),
    datetime(2026, 12, 5, 0, 0, tzinfo=timezone.utc), datetime(1, 1, 1, tzinfo=timezone.utc),
    datetime(2026, 12, 5, 12, 0, 0, 999999, tzinfo=timezone(timedelta(hours=2))),
    datetime(2026, 12, 5, 12, 0, tzinfo=timezone(timedelta(hours=-5, minutes=-30))),
    datetime(2026, 12, 5, 12, 0), datetime(2026, 12, 5, 0, 0, 0, 1000)], ids=str)
def test_a_timestamp_is_written_as_the_release_before_wrote_it(moment):
    from tasks.jobstate import iso

    assert iso(moment) == _iso_before(moment)
