"""A models file checked as the processes that will run it would take it, before anything
changes (`make reload`, scripts/reload.py; `make run`, scripts/run.py): it parses, its Redis
groups are configured (here, and in every live process that reported what it can serve:
tasks/serves.py), each model file it names opens, each package it names is installed. A file
that fails one of these would stop every process that reads it, which `make run`'s keepers
would restart for ever."""
from __future__ import annotations

import importlib.util
import os
import zipfile
from pathlib import Path
from typing import Callable, Mapping

from config.groups import check_model_groups
from config.kinds import kind_of
from config.models import ModelSpec, parse_models
from tasks.serves import cuda_only, unservable


def _unloadable(spec) -> str | None:
    """Why a worker's pool child could not even open the model's file or folder, or None.
    A reload's child that cannot load its models rolls its worker back
    (workers/batching/reload.py): a file none can open is refused here, before any worker tries it.
    The tensor kinds' files (TorchScript `.pt`, torch.export `.pt2`) are zip archives, so a
    truncated or garbage file is seen here without loading it."""
    path = Path(spec.path)
    if not path.exists():
        return f"{spec.path} does not exist"
    if kind_of(spec.kind).archive:
        if not path.is_file():
            return f"{spec.path} is not a file"
        try:
            with path.open("rb") as fh:
                if not zipfile.is_zipfile(fh):
                    return f"{spec.path} is not a TorchScript or torch.export archive " \
                           "(truncated or corrupt?)"
        except OSError as exc:
            return f"{spec.path} cannot be read: {exc.strerror or exc}"
    elif path.is_dir():
        try:
            next(os.scandir(path), None)
        except OSError as exc:
            return f"{spec.path} cannot be read: {exc.strerror or exc}"
    else:
        try:
            path.open("rb").close()
        except OSError as exc:
            return f"{spec.path} cannot be read: {exc.strerror or exc}"
    return None


def problems_of(target: Path, content: bytes, groups: Mapping[str, str],
                reports: Mapping[str, dict] | None = None,
                before: Mapping[str, ModelSpec] | None = None,
                waiting: Callable[[str, str], int] | None = None, *,
                host_gpus: int | None = None) -> list[str]:
    """Why the models file `content`, to be read at `target`, cannot be served (none: it
    can): by the settings here (`groups`), by this host's GPUs (`host_gpus`, when given:
    `make run`, its keepers, a reload no worker reports on), by what the live processes
    reported they can serve (`reports`, by process: tasks/serves.py), by the files and
    packages it names, and, given the models it replaces (`before`) and how many jobs wait on
    a queue of a Redis group (`waiting(group, queue)`), by the jobs a model moved to another
    group would leave.
    ConfigError for a file that does not parse or names a group `groups` lacks."""
    models = parse_models(target, content)
    check_model_groups(models, groups)  # a Redis group the settings lack: ConfigError
    problems = unservable(models, reports or {})
    if host_gpus == 0:  # this host's GPUs (nvidia-smi: workers/child/devices.py), none
        problems += [f"models.{spec.name}.device: 'cuda', but this host has no GPU "
                     "(nvidia-smi lists none): its worker's children could not load it"
                     for spec in models.values() if cuda_only(spec)]
    if before and waiting:
        problems += stranded(before, models, waiting)
    for spec in models.values():
        why = _unloadable(spec) if spec.path else None
        if why:
            problems.append(f"models.{spec.name}: {why}")
        if spec.package and importlib.util.find_spec(spec.package) is None:
            problems.append(f"models.{spec.name}: package {spec.package} is not installed")
    return problems


def stranded(before: Mapping[str, ModelSpec], after: Mapping[str, ModelSpec],
             waiting: Callable[[str, str], int]) -> list[str]:
    """A model moved to another Redis group while jobs of it wait on its queue on the old
    group's Redis: once no worker there consumes that queue they would wait for ever (a
    queue's move, tasks/queuemoves.py, is within one Redis, and a renamed queue as well would
    move them onto a queue of the old Redis no worker reads). Refused until drained."""
    problems = []
    for name in sorted(before.keys() & after.keys()):
        old, new = before[name], after[name]
        if old.redis == new.redis:
            continue
        jobs = waiting(old.redis, old.queue)
        if jobs:
            also = f" and queue {old.queue} -> {new.queue}" if old.queue != new.queue else ""
            problems.append(
                f"models.{name}.redis: {old.redis or 'REDIS_URL'} -> {new.redis or 'REDIS_URL'}"
                f"{also} while {jobs} job(s) wait on queue {old.queue} on "
                f"{'group ' + old.redis if old.redis else 'REDIS_URL'}'s Redis: drain it first "
                f"(stop submitting, wait for iq_queue_depth 0)")
    return problems
