"""The models one pool child owns: loaded on its device after the child starts, warmed up with a
full-size batch, announced live through a heartbeat, and run batch by batch; with the child's
Celery app, which builds the task messages a batch queues (webhook deliveries)."""
from __future__ import annotations

import enum
import logging
import threading
import time
from typing import Any, Sequence

import redis

from config import Settings
from config.calibration import sized
from config.models import ModelSpec
from tasks.errors import ErrorCode, JobError
from tasks.jobstate import JobState
from tasks.keys import live_key, versions_key
from tasks.presence import Presence
from tasks.redis_client import connect
from workers.child.handlers import Handler, build_handler, handler_class
from workers.child.handlers.base import Progress
from workers.child.versions import model_version

logger = logging.getLogger(__name__)

def load_handler(spec: ModelSpec, device: str, settings: Settings,
                 memory_fraction: float = 0.0) -> Handler:
    """A model loaded as a pool child loads it: device prepared, weights loaded, warmed up with
    a full-size batch (a model that runs no torch: no device to prepare). The batch-size
    calibrator (scripts.calibrate) loads through here too."""
    from workers.child.devices import prepare_device

    handler = build_handler(spec, device)
    if handler.runs_torch:
        prepare_device(device, settings, memory_fraction)
    handler.initialize()
    handler.warmup()
    return handler


class State(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DEFUNCT = "defunct"


class ModelRuntime:
    def __init__(self, app: Any, settings: Settings, specs: dict[str, ModelSpec],
                 models: Sequence[str], hostname: str, index: int) -> None:
        self.app = app
        self.settings = settings
        self.all_specs = specs
        self.specs = {m: specs[m] for m in models}
        self.member = f"{hostname}/{index}"
        self.index = index
        self.handlers: dict[str, Handler] = {}
        self.versions: dict[str, str] = {}  # model → the version this child serves
        self._fractions: dict[str, float] = {}
        self.state = State.STARTING
        self._stop = threading.Event()
        self._redis = connect(settings.redis_url, settings)
        # The job records this child moves (start, finish): tasks/jobstate.py.
        self.jobs = JobState(self._redis, settings.kept_s, settings.job_ttl_s)
        self._presence = Presence(self._redis)

    def start(self) -> None:
        from workers.child.devices import configure_allocator

        configure_allocator(self.settings)
        for name in self.specs:
            self._load(name)
        self.state = State.READY
        # The heartbeat thread first: a Redis that is away now must not stop the beats that
        # will announce this child once it is back.
        threading.Thread(target=self._heartbeat, name="iq-heartbeat", daemon=True).start()
        try:
            self._beat()
        except redis.RedisError as exc:
            logger.warning("first heartbeat refused (%s); retrying every %gs", exc,
                           self.settings.heartbeat_interval_s)

    @property
    def ready(self) -> bool:
        return self.state is State.READY

    def _load(self, name: str) -> Handler:
        from workers.child.devices import device_for

        declared, device = self.all_specs[name], ""
        started = time.monotonic()
        try:
            device = device_for(declared, self.index, handler_class(declared.kind).runs_torch)
            # Its warm-up and its chunks at the batch its worker hands it: on a GPU, the
            # calibrator's answer (config/calibration.py), not the models file's default.
            spec = sized(declared, self.settings, device.startswith("cuda"))
            # CUDA caps memory per process: this child's cap on a device is the sum of the
            # fractions of the models it holds there.
            fraction = self._fractions.get(device, 0.0) + spec.memory_fraction
            handler = load_handler(spec, device, self.settings, fraction)
        except Exception as exc:  # said with the model's name (tasks/reload_failures.py)
            exc.add_note(f"model {name} on {device}" if device else f"model {name}")
            raise
        self._fractions[device] = fraction
        self.handlers[name] = handler
        self.specs[name] = spec
        self.versions[name] = model_version(spec)
        logger.info("model %s version %s ready on %s (%s) in %.1fs (child %s)", name,
                    self.versions[name], device, spec.dtype, time.monotonic() - started,
                    self.member)
        return handler

    def run(self, model: str, jobs: list[tuple[list, dict]],
            progress: Progress | None = None,
            waiting_since: float | None = None) -> list[list | JobError]:
        assert self.state is State.READY, f"runtime is {self.state.value}"
        handler = self.handlers.get(model)
        if handler is None:
            if model not in self.all_specs:
                missing = JobError(ErrorCode.MODEL_UNAVAILABLE, f"no model {model} configured")
                return [missing] * len(jobs)
            # The worker was told to consume this model's queue after it started
            # (`celery control add_consumer`): load it now, once.
            logger.info("loading %s on first use (queue added at run time)", model)
            handler = self._load(model)
            self._beat()
        return handler.run(jobs, progress, waiting_since)

    def record_memory(self, model: str) -> None:
        """What torch holds on the model's GPU, in the worker's metrics (here, in the child:
        workers/metrics.py, which the main process and the deliverer import, never imports
        torch)."""
        handler = self.handlers.get(model)
        if handler is None or not handler.runs_torch or not handler.device.startswith("cuda"):
            return
        import torch

        from workers import metrics
        from workers.child.devices import nvml_utilization

        device = handler.device
        metrics.get().gpu_allocated.labels(device).set(torch.cuda.memory_allocated(device))
        metrics.get().gpu_reserved.labels(device).set(torch.cuda.memory_reserved(device))
        utilization = nvml_utilization(device)
        if utilization is not None:
            metrics.get().gpu_utilization.labels(device).set(utilization)

    def stop(self) -> None:
        self.state = State.DEFUNCT
        self._stop.set()
        try:
            with self._redis.pipeline(transaction=False) as pipe:
                for name in self.specs:
                    pipe.zrem(live_key(name), self.member)
                    pipe.hdel(versions_key(name), self.member)
                pipe.execute()
        except redis.RedisError:
            pass

    # Liveness lives in Redis so the API can answer /readyz without a broadcast to workers;
    # stamped by Redis's clock, so that a worker whose clock is off is judged like any other.
    def _beat(self) -> None:
        self._presence.beat([live_key(name) for name in list(self.specs)], self.member,
                            6 * self.settings.heartbeat_ttl_s)
        if self.versions:  # what each model's copy here serves (GET /v1/models)
            with self._redis.pipeline(transaction=False) as pipe:
                for name, version in list(self.versions.items()):
                    pipe.hset(versions_key(name), self.member, version)
                pipe.execute()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_interval_s):
            try:
                self._beat()
            except redis.RedisError as exc:
                logger.warning("heartbeat failed: %s", exc)


_runtime: ModelRuntime | None = None


def start_runtime(app: Any, hostname: str, index: int) -> ModelRuntime:
    """This child's runtime, for `app` (its settings and models file): the models whose
    queues the worker consumes (IQ_WORKER_MODELS), all of them by default."""
    global _runtime
    settings, specs = app.conf.iq_settings, app.conf.iq_models
    wanted = [m for m in settings.worker_models.split(",") if m] or list(specs)
    _runtime = ModelRuntime(app, settings, specs, wanted, hostname, index)
    _runtime.start()
    return _runtime


def runtime() -> ModelRuntime:
    if _runtime is None:
        raise RuntimeError("no model runtime in this process: models load in pool children")
    return _runtime


def stop_runtime() -> None:
    if _runtime is not None:
        _runtime.stop()
