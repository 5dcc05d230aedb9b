"""The job stores of every Redis group behind one API (config/groups.py): one JobStore
(app/store.py) per group, and what spans them.

Each group has a store of its own: its Redis connections, a Celery app for its messages and
revokes, its result listener (the waits on its jobs), its gauge (queue depth and memory checks
on its Redis). The views look up the store a job's id names (`for_job`), or a model's group's
to submit to (`for_model`), and call that JobStore directly; listing merges the groups' pages;
the queue depths, kept requests, live instances and readiness are read from each. A group
whose Redis is down answers 503 for its models and its jobs (JobStore.answering); the others
are not held by it. With no groups configured there is one store, REDIS_URL's."""
from __future__ import annotations

import contextvars
import logging
import threading
from dataclasses import replace
from typing import Callable, Iterable, TypeVar

import redis

from app.errors import Unavailable
from app.store import JobStore, group_name, page_reads, parse_job_id
from app.waiter import Slots
from config import Settings
from config.job_ids import group_of, group_tag
from config.models import ModelSpec
from tasks.celery_app import make_celery
from tasks.jobstate import JobRecord, Page

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Stores:
    """The job stores, by group ("" : REDIS_URL's): the lookups that give a model's or a job's
    own store (the views call it directly), and the reads that span every group."""

    def __init__(self, settings: Settings, models: dict[str, ModelSpec], revision: str) -> None:
        self.settings, self.models = settings, models
        groups = settings.redis_group_urls
        self.tags = {group_tag(name): name for name in groups}
        slots = Slots(settings.max_waits, settings.max_waits_per_key)
        self.stores: dict[str, JobStore] = {"": JobStore(
            settings, make_celery(settings, models, revision), _of(models, ""), slots)}
        for name, url in groups.items():
            # A group's Redis is a plain URL: Sentinel (redis_sentinels) is REDIS_URL's only.
            own = replace(settings, redis_url=url, redis_sentinels="")
            self.stores[name] = JobStore(own, make_celery(own, models, revision),
                                         _of(models, name), slots, group=name)
        self.default = self.stores[""]
        # What the rate limits, the models reload and the tests use: REDIS_URL's.
        self.redis, self.waiter, self.state = (self.default.redis, self.default.waiter,
                                               self.default.state)

    def for_model(self, spec: ModelSpec) -> JobStore:
        """The store of the model's group: where its jobs are submitted."""
        return self.stores[spec.redis]

    def for_job(self, job_id: str) -> tuple[str, JobStore] | None:
        """The canonical form of a job id and the store of the group it names, where every
        call on that job goes (the views make them on it directly, within its `answering`:
        app/jobs.py's `on_job`). None for an id this service cannot have issued: not a UUID,
        or of no configured group (a group since removed), which each view answers as the
        job it does not find."""
        canonical = parse_job_id(job_id)
        group = None if canonical is None else group_of(canonical, self.tags)
        return None if group is None else (canonical, self.stores[group])

    def page(self, owner: str, *, status: str = "", model: str = "",
             cursor: tuple[str, str] | None = None,
             limit: int = 20) -> tuple[Page, list[str]]:
        """A page of the owner's jobs, newest first, from every group (JobStore.page); with
        `model`, from that model's group alone. And the groups that could not be read
        (`redis:<group>`, `redis` for REDIS_URL's), whose jobs the page lacks: one frozen or
        down group does not hold or fail the listing of the others (503 naming it when none
        can be read)."""
        if len(self.stores) == 1 or model:
            store = self.for_model(self.models[model]) if model else self.default
            with store.answering():
                return store.page(owner, status=status, model=model, cursor=cursor,
                                  limit=limit), []
        pages: list[Page] = []
        down: dict[str, redis.RedisError] = {}
        for group, page in self._each(lambda store: store.page(
                owner, status=status, cursor=cursor, limit=limit)).items():
            if isinstance(page, redis.RedisError):
                logger.warning("jobs of %s unlisted: %s", group_name(group), page)
                down[group] = page
            elif isinstance(page, BaseException):
                raise page
            else:
                pages.append(page)
        if not pages:
            first = next(iter(down))
            raise _down(first, down[first], "no Redis group answered the listing")
        return merge_pages(pages, limit), [f"redis:{g}" if g else "redis" for g in down]

    def scan_cost(self, *, status: str = "", model: str = "", limit: int = 20) -> int:
        """The index entries a page (`page`) may read at most: app/store.py's `page_reads`
        (what each group's page is given to read) for each group it reads."""
        groups = 1 if len(self.stores) == 1 or model else len(self.stores)
        return groups * page_reads(status=status, model=model, limit=limit)

    def queue_depths(self) -> dict[str, int]:
        """Each model's queue depth, from its group's Redis; a group that cannot be read
        leaves its models out (the scrape's other models are still right)."""
        depths: dict[str, int] = {}
        read = self._each(lambda store: store.queue_depths() if store.models else {})
        for group, found in read.items():
            if isinstance(found, redis.RedisError):
                logger.warning("queue depths of %s unread: %s", group_name(group), found)
            elif isinstance(found, BaseException):
                raise found
            else:
                depths.update(found)
        return depths

    def kept(self) -> tuple[int, int]:
        """Requests kept for retries, and their bytes, over every group (raises while one
        cannot be read: the gauge is left out of that scrape rather than understated)."""
        counts = list(self._each(lambda store: store.state.kept()).values())
        for found in counts:
            if isinstance(found, BaseException):
                raise found
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    def live(self, models: Iterable[str]) -> dict[str, dict]:
        """JobStore.live, each model's read from its group's Redis. A group that cannot be read
        leaves its models' counts unknown (None) and names itself in their `unreachable`, so
        that the other groups' models are still shown; 503 when no group can be read."""
        live: dict[str, dict] = {}
        by_group = self._by_group(models)
        read = self._each(lambda store: store.live(by_group[store.group])
                          if by_group.get(store.group) else {})
        down = [group for group, found in read.items() if isinstance(found, redis.RedisError)]
        if len(down) == len(read):
            raise _down(down[0], read[down[0]], "its models' instances are unknown") from None
        for group, found in read.items():
            if isinstance(found, redis.RedisError):
                unknown = {"workers": None, "instances": None, "versions": None,
                           "unreachable": f"redis:{group}" if group else "redis"}
                live.update({name: unknown for name in by_group.get(group, [])})
            elif isinstance(found, BaseException):
                raise found
            else:
                live.update(found)
        return live

    def readiness(self, models: Iterable[str]) -> tuple[dict[str, dict], dict[str, dict]]:
        """/readyz's Redis checks (`redis`, and `redis:<group>` per group) and the live
        instances of the models whose Redis answers."""
        checks: dict[str, dict] = {}
        live: dict[str, dict] = {}
        by_group = self._by_group(models)

        def check(store: JobStore) -> dict[str, dict]:
            store.ping()
            return store.live(by_group[store.group]) if by_group.get(store.group) else {}

        for group, found in self._each(check).items():
            name = f"redis:{group}" if group else "redis"
            if isinstance(found, redis.RedisError):
                checks[name] = {"ok": False, "error": "unreachable"}
            elif isinstance(found, BaseException):
                raise found
            else:
                live.update(found)
                checks[name] = {"ok": True}
        return checks, live

    def _each(self, call: Callable[[JobStore], T]) -> dict[str, T | BaseException]:
        """`call` on every group's store at once, a thread each (a greenlet under gunicorn's
        gevent worker), so that a group whose Redis does not answer costs one deadline, not one
        after another's: {group: what it returned, or what it raised}, in the groups' order.
        Each thread runs in a copy of the caller's context: the request's one deadline
        (tasks/redis_deadline.py) bounds them all. One store: called here."""
        if len(self.stores) == 1:
            try:
                return {"": call(self.default)}
            except Exception as exc:  # noqa: BLE001 - the caller tells the kinds apart
                return {"": exc}
        found: dict[str, T | BaseException] = {}

        def run(group: str, store: JobStore) -> None:
            try:
                found[group] = call(store)
            except Exception as exc:  # noqa: BLE001 - the caller tells the kinds apart
                found[group] = exc

        threads = [threading.Thread(target=contextvars.copy_context().run,
                                    args=(run, group, store), daemon=True,
                                    name=f"iq-group-{group or 'default'}")
                   for group, store in self.stores.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return {group: found[group] for group in self.stores}

    def _by_group(self, models: Iterable[str]) -> dict[str, list[str]]:
        by_group: dict[str, list[str]] = {}
        for name in models:
            by_group.setdefault(self.models[name].redis, []).append(name)
        return by_group

    def ping(self) -> bool:
        return all(store.ping() for store in self.stores.values())

    def close(self) -> None:
        """Stop every result listener (an app that outlives its Redis servers, in tests)."""
        for store in self.stores.values():
            store.waiter.close()


def _of(models: dict[str, ModelSpec], group: str) -> dict[str, ModelSpec]:
    return {name: spec for name, spec in models.items() if spec.redis == group}


def _down(group: str, exc: Exception, more: str) -> Unavailable:
    logger.warning("%s unavailable: %s", group_name(group), exc)
    return Unavailable(f"{group_name(group)} is unreachable; retry later ({more})",
                       retry_after=1)


def merge_pages(pages: list[Page], limit: int) -> Page:
    """One page of the groups' pages, each read from the same cursor: their jobs newest first
    (by index time, then id, as each index orders them), only down to the furthest point
    every group has been read to (the newest of their cursors), so that the next page, read
    from the cursor given here, misses none and repeats none."""
    entries: list[tuple[tuple[int, str], JobRecord]] = []
    frontier: tuple[int, str] | None = None
    for page in pages:
        entries += [((us, job.id), job) for job, us in zip(page.jobs, page.times)]
        if page.cursor:
            reached = (int(page.cursor[0]), page.cursor[1])
            frontier = reached if frontier is None else max(frontier, reached)
    entries.sort(key=lambda entry: entry[0], reverse=True)
    if frontier is not None:
        entries = [entry for entry in entries if entry[0] >= frontier]
    following = entries[limit - 1][0] if len(entries) > limit else frontier
    return Page([job for _, job in entries[:limit]],
                (str(following[0]), following[1]) if following else None,
                [us for (us, _), _ in entries[:limit]])
