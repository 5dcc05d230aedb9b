"""The end of a reload (scripts/reload.py, once every live process serves the new models
file): the jobs still queued for a model the file does not have end `failed` with
`model_removed`, as a worker consuming that model's queue at the reload fails them
(workers/batching/reload.py). Without this, jobs queued while no running worker consumed the queue
(its only worker stopped) waited for ever: a worker started later reads the new file and never
consumes that queue.

Which queues: those of the jobs not final yet (tasks/keys.py PENDING_KEY) whose model is not in
the new file. So a model removed by a reload of the file in place (no previous file to compare
with), or by an earlier reload that left jobs behind, is found the same way. Each message on
those queues' lists (every priority step) whose task is a removed model's is taken off its list
and its job failed in one step (JobState.finish_queued): record, stored result, dead-letter
index and webhook as a worker's failure writes them. A message a worker fetched meanwhile is
not there any more: it is the worker's to settle, and one fetched after was failed already
(its start is refused)."""
from __future__ import annotations

import base64
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterator

import orjson
import redis
from redis.client import NEVER_DECODE

from config import ConfigError, Settings
from config.models import ModelSpec, parse_models, revision_of
from tasks.celery_app import make_celery
from tasks.errors import removed_error
from tasks.jobstate import Final, JobState, queue_of
from tasks.keys import PENDING_KEY, REMOVED_FAILED_KEY, job_key
from tasks.names import model_of_task, queue_lists
from workers.child.batch import BatchJob, failed

CHUNK = 500


def fail_removed_jobs(client: redis.Redis, settings: Settings, target: Path, revision: str,
                      say: Callable[[str], None], removed_before: int | None = None) -> bool:
    """Fail the jobs queued for models the models file at `target` (of `revision`) does not
    have, saying how many; False when Redis refused (the jobs left are failed by the next
    reload). `removed_before`: the count of jobs ended `model_removed` on this Redis when the
    reload was announced (tasks/keys.py REMOVED_FAILED_KEY): it also says how many ended so
    since, the workers' (which fail most as they meet them) and its own."""
    try:
        content = target.read_bytes()
        if revision_of(content) != revision:
            say(f"{target} changed since it was announced: the jobs queued for removed models "
                "are left for the next reload")
            return True
        failed_by = fail_removed(client, settings, parse_models(target, content), revision)
    except (OSError, ConfigError) as exc:
        say(f"{target} cannot be read again ({exc}): the jobs queued for removed models are "
            "left for the next reload")
        return True
    except redis.RedisError as exc:
        say(f"the jobs queued for removed models could not be failed (Redis: {exc}): "
            "`make reload` again fails them")
        return False
    say("jobs queued for removed models: " + (", ".join(
        f"{n} for {model}" for model, n in sorted(failed_by.items())) or "none") +
        (" failed with model_removed" if failed_by else "") + _in_all(client, removed_before))
    return True


def _in_all(client: redis.Redis, before: int | None) -> str:
    """"; N in all …": the jobs ended `model_removed` on this Redis since the announcement."""
    if before is None:
        return ""
    try:
        since = int(client.get(REMOVED_FAILED_KEY) or 0) - before
    except redis.RedisError:
        return ""
    return f"; {since} job(s) ended model_removed in all since the reload was announced " \
           "(the workers fail those they meet)"


def fail_removed(client: redis.Redis, settings: Settings, models: dict[str, ModelSpec],
                 revision: str) -> dict[str, int]:
    """Fail the queued jobs of models not in `models`: how many this call failed, by model."""
    queues = removed_queues(client, models)
    if not queues:
        return {}
    state = JobState(client, settings.kept_s, settings.job_ttl_s)
    app = make_celery(settings, models, revision)  # builds webhook messages only
    failed_by: dict[str, int] = {}
    for queue in sorted(set().union(*queues.values())):
        for list_key in queue_lists(queue):
            for raw in client.execute_command("LRANGE", list_key, 0, -1,
                                              **{NEVER_DECODE: True}):
                model, final = failure(app, raw, models)
                if final is not None and state.finish_queued(
                        list_key, raw, final, result_ttl_s=settings.result_ttl_s):
                    failed_by[model] = failed_by.get(model, 0) + 1
    return failed_by


def removed_queues(client: redis.Redis, models: dict[str, ModelSpec]) -> dict[str, set[str]]:
    """The queues of the jobs not final yet whose model is not in `models`, by model."""
    return {model: queues for model, queues in pending_queues(client).items()
            if model not in models}


def pending_queues(client: redis.Redis) -> dict[str, set[str]]:
    """The queues the jobs not final yet were sent to (their records' `list`), by model."""
    out: dict[str, set[str]] = {}
    for members in _chunks(client.zscan_iter(PENDING_KEY, count=CHUNK)):
        with client.pipeline(transaction=False) as pipe:
            for job_id, _score in members:
                pipe.hmget(job_key(_text(job_id)), "model", "list")
            found = pipe.execute()
        for model, list_key in found:
            if model and list_key:
                out.setdefault(_text(model), set()).add(queue_of(_text(list_key)))
    return out


def failure(app: Any, raw: bytes, models: dict[str, ModelSpec]) -> tuple[str, Final | None]:
    """(model, the failure of its job) for a queued message whose task is a model's not in
    `models`; ("", None) for any other (a kept model's, one that cannot be read: left)."""
    try:
        payload = orjson.loads(raw)
        headers = payload["headers"]
        model = model_of_task(str(headers.get("task") or ""))
        if not model or model in models:
            return "", None
        body = payload["body"]
        if (payload.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        _args, kwargs, _embed = orjson.loads(body)
        job = BatchJob.of_message(headers, kwargs)
    except (ValueError, KeyError, TypeError, AttributeError):
        return "", None
    return model, failed(app, job, removed_error(model))


def _chunks(items: Iterator, size: int = CHUNK) -> Iterator[list]:
    while chunk := list(islice(items, size)):
        yield chunk


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
