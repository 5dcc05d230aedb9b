"""What a running process can serve, as it says beside where it stands with a reload
(tasks/keys.py RELOAD_STATUS_KEY: workers/batching/reload.py, app/reloading.py), and a models file
checked against what every live process said, before a reload changes anything
(scripts/reload.py). A file is checked against the environment of the processes that will run
it, not the operator's shell: a group exported only in the shell that runs `make reload` once
passed the check there and crash-looped every process that read the file.

A report's part here: `groups`, the Redis groups (redis_groups) the process is configured
with, since every API process and worker builds a client per group a model names, and stops
on one it lacks (tasks/celery_app.py); a worker's `gpus` (CUDA devices its children may use,
asked of nvidia-smi, never of CUDA in the main process), `queues` (those it consumes) and
`consumes_all` (it consumes a new model's queue too). A report without a part (an older
process) is not checked for it."""
from __future__ import annotations

from typing import Any, Mapping

from config import Settings
from config.models import ModelSpec

_NAMED = 3  # processes named in a refusal; the rest counted


def capabilities(settings: Settings, **worker: Any) -> dict[str, Any]:
    """The report's part for a process with `settings` (a worker adds gpus, queues,
    consumes_all)."""
    return {"groups": sorted(settings.redis_group_urls), **worker}


def _named(processes: list[str]) -> str:
    more = len(processes) - _NAMED
    return ", ".join(processes[:_NAMED]) + (f" and {more} more" if more > 0 else "")


def _serves(report: Mapping[str, Any], queue: str) -> bool:
    return bool(report.get("consumes_all")) or queue in (report.get("queues") or ())


def unservable(models: Mapping[str, ModelSpec],
               reports: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per model field a live process could not serve (none: the file fits every
    one), each naming the field, the value and the processes. `reports`: by field
    (`worker:<node>`, `api:<host>/<pid>`)."""
    problems = []
    for name, spec in models.items():
        if spec.redis:
            lacking = sorted(p for p, r in reports.items()
                             if "groups" in r and spec.redis not in r["groups"])
            if lacking:
                problems.append(
                    f"models.{name}.redis: group {spec.redis!r} is not configured in the running "
                    f"API/worker processes ({_named(lacking)}): add it to their IQ_REDIS_GROUPS "
                    "and restart them before a reload names it")
        if cuda_only(spec):
            bare = sorted(p for p, r in reports.items()
                          if r.get("gpus") == 0 and _serves(r, spec.queue))
            if bare:
                problems.append(
                    f"models.{name}.device: 'cuda', but the running worker(s) {_named(bare)} "
                    f"that would serve queue {spec.queue!r} see no CUDA device")
    return problems


def cuda_only(spec: ModelSpec) -> bool:
    """Whether the model loads only on a CUDA device (an int8 one runs on the CPU)."""
    return spec.device == "cuda" and spec.dtype != "int8"


def unconsumed(models: Mapping[str, ModelSpec],
               workers: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[str]:
    """One line per model whose queue no live worker on its Redis would consume.
    `workers`: each Redis group's ("" the default's) live workers' reports, by field."""
    problems = []
    for name, spec in models.items():
        group = spec.redis or ""
        there = workers.get(group) or {}
        where = f"group {group!r}" if group else "the default Redis"
        if not there:
            problems.append(f"models.{name}.redis: no worker runs on {where}: its jobs would "
                            "wait there for ever; start one there before a reload moves it")
        elif not any(_serves(r, spec.queue) or not ({"queues", "consumes_all"} & r.keys())
                     for r in there.values()):  # a report without them: not checked
            problems.append(f"models.{name}.queue: no worker on {where} consumes queue "
                            f"{spec.queue!r}: its jobs would wait there for ever; start one "
                            "that does (its -Q) before a reload names it")
    return problems
