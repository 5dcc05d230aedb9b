"""Service settings, layered: defaults in this file → a YAML file → environment variables.

The API, the workers and the scripts all read the same `Settings`, so a value set once (say
`REDIS_URL`) reaches every process. Nothing here imports torch or Flask.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

import yaml

from config.checks import ConfigError, check, shown_url
from config.groups import groups_text, parse_groups, shown_groups

CONFIG_DIR = Path(__file__).resolve().parent
PROJECT_DIR = CONFIG_DIR.parent


@dataclass(frozen=True)
class Settings:
    # Redis is the broker, the result backend and the job store: one server, because a submit
    # records the job and queues its message in one atomic script (tasks/jobstate.py).
    redis_url: str = "redis://127.0.0.1:6379/0"
    # More Redis servers, by name (name=url,name=url; a mapping in the YAML file), for when
    # one Redis is the limit: a model whose entry says `redis: <name>` has its queue, records
    # and results on that one (config/groups.py). None by default: every model on redis_url.
    redis_groups: str = ""
    models_file: str = str(CONFIG_DIR / "models.yaml")
    # A reload replaces a worker's last serving child only once a new child, started beside
    # it (the pool one larger for the time it loads: on a GPU, a second copy of the models on
    # the same device meanwhile), serves the new file. Off: it goes first, in its turn among
    # the workers on its queues (a worker alone on them serves nothing while the new loads).
    reload_surge: bool = True

    # Access layer.
    max_body_bytes: int = 1_048_576
    max_wait_s: float = 30.0
    # Requests parked on `?wait` or `Prefer: wait` at once in one API process, in all and per
    # API key (keys off: only the first cap applies). Past either, `GET ?wait` answers 429
    # with Retry-After and `Prefer: wait` is not applied (202 at once): a wait never queues
    # behind other waits. gunicorn.conf.py sizes the process's connections from max_waits.
    max_waits: int = 2000
    max_waits_per_key: int = 500
    # A request's body must have arrived this long after its headers (app/request_body.py);
    # later, 408. Proxy headers (SCRIPT_NAME, X-Forwarded-*) are honoured only from these
    # addresses or CIDRs, comma-separated (gunicorn.conf.py); none by default.
    body_timeout_s: float = 30.0
    # Request bodies one API key may be sending to one API process at once; past it, 429 at
    # once and the connection closed (app/limits.py). 0: no cap.
    max_uploads_per_key: int = 64
    # One API key's read budget per API process (app/limits.py), in units a second and saved:
    # a /v1 request but a submit costs 1, a listing what its page may scan. 0: no limit.
    read_rate_per_key: float = 1000.0
    read_burst_per_key: int = 2000
    forwarded_allow_ips: str = ""
    # Connecting to Redis may take this long (workers; the API's calls are bounded by
    # redis_deadline_s instead).
    redis_timeout_s: float = 2.0
    # The most one Redis call on a request's path in the API may take, its retries included
    # (submit, read, cancel, a wait's reads, readiness, rate limits): past it the request is
    # answered, 503 with Retry-After, rather than held while Redis is frozen or unreachable.
    redis_deadline_s: float = 2.0
    # Redis Sentinel: the sentinels (host:port, comma-separated) and the name of the primary
    # they watch. When set, every process asks them where the primary is, and again after a
    # failover; REDIS_URL then gives the user, password, database and scheme, not the host.
    redis_sentinels: str = ""
    redis_master: str = "mymaster"
    # The sentinels' own user and password, when they take one.
    redis_sentinel_user: str = ""
    redis_sentinel_password: str = ""
    # A submit answers 202 once this many replicas hold the job (Redis WAIT, at most
    # redis_wait_timeout_s); else 503, the job recorded on the primary. -1: 1 with Sentinel,
    # 0 (no wait) without.
    redis_wait_replicas: int = -1
    redis_wait_timeout_s: float = 1.0
    job_ttl_s: int = 86_400
    # How long a finished job's outputs stay readable: what bounds Redis's memory under steady
    # load (bench/README.md: ~6 KB a 384-float embedding job, ~3 KB as base64).
    result_ttl_s: int = 3_600
    # When Redis has a maxmemory, new jobs are refused (503) once less than this share of it
    # is left, so that the jobs already accepted always have room for their results.
    redis_memory_headroom: float = 0.1
    # A job that fails, is cancelled or expires keeps its request (inputs and options) this
    # long (at most job_ttl_s), so that it can be retried (POST /v1/jobs/<id>/retry); 0: none
    # is kept. Only requests of at most kept_inputs_max_bytes (as JSON) are kept, in the
    # record while the job waits: a job that succeeds drops its own.
    kept_inputs_ttl_s: int = 3_600
    kept_inputs_max_bytes: int = 262_144
    # The bytes of the requests Redis keeps for one API key (its waiting jobs', whatever their
    # size, those kept for a retry), on each Redis: past it a submit is 429 `kept_full`. 0, or
    # keys off: no quota.
    kept_bytes_per_key: int = 67_108_864
    api_keys_file: str = ""  # YAML of hashed API keys; none: the API is open

    # Webhooks. Hosts (or CIDRs) allowed even though they are private/loopback/link-local.
    webhook_allow: str = ""
    # No default: webhooks stay off until it is set (tasks.webhooks.enabled). Only the
    # deliverer signs; a process that only queues deliveries (the API) may instead be told
    # that webhooks are on, and hold no secret.
    webhook_secret: str = ""
    webhooks_enabled: bool = False
    webhook_retries: int = 8
    webhook_backoff_s: float = 2.0
    webhook_timeout_s: float = 10.0  # the whole delivery, however slowly the receiver answers
    # Deliveries in flight to one host, per deliverer process: a slow receiver holds at most
    # this many of the deliverer's threads.
    webhook_host_concurrency: int = 2

    # Image URLs (app/image_urls.py): hosts (or CIDRs) the API may fetch images from although
    # they are not public, and one deadline for all of a job's fetches.
    image_url_allow: str = ""
    image_fetch_deadline_s: float = 10.0
    # Image decoding (app/decoder_pool.py): decoder processes per API process, the time each image
    # may take, the decoding time all of a job's images share, the memory (address space) each
    # decoder may use, and the decoders one API key may hold at once (0: half of them, at
    # least one; keys off: no cap).
    image_decoders: int = 2
    image_decode_timeout_s: float = 5.0
    image_decode_budget_s: float = 10.0
    image_decode_memory_mb: int = 1024
    image_decoders_per_key: int = 0

    # Workers.
    heartbeat_interval_s: float = 2.0
    heartbeat_ttl_s: float = 10.0
    # Model loading and warm-up run inside the pool child before it reports ready; Celery's
    # default of 4 s would kill a child that is still loading a large model.
    proc_alive_timeout_s: float = 300.0
    # A worker holds a lease on every message it has taken (buffered or running) and renews
    # it every heartbeat_interval_s while it lives; when a worker dies, any live worker puts
    # its messages back on their queues once their lease is this old. A long batch needs no
    # longer timeout: its lease is renewed while it runs.
    visibility_timeout_s: int = 30
    # How long a pool child keeps retrying Redis (to mark a batch started, to store its
    # results) through a restart or a stall before handing the jobs back to their queue.
    redis_retry_s: float = 30.0
    # The worker restarts itself when its event loop has not turned for this long while
    # Redis answers, or when it has stayed idle this long with jobs waiting on its queues.
    watchdog_s: float = 60.0
    # A pool child that died mid-batch is noticed after this long.
    worker_lost_wait_s: float = 1.0
    # A job whose model call took its pool child down this many times (the last time alone in
    # its batch) ends failed with code `crashed` and never runs again; its batch-mates run
    # again alone and finish.
    max_job_crashes: int = 2
    # A worker told to stop (SIGTERM) lets its running batches finish for this long, then
    # stops their children and puts their jobs back on the queues.
    stop_timeout_s: float = 25.0
    # Whom `make run` starts its parts as: `one`, the user who runs it; `separate` (make run
    # as root, after `make users`), each part as a system user of its own (scripts/run_users.py).
    run_users: str = "one"
    # Messages a worker holds unacknowledged per child; 0: two full batches of the largest
    # model it serves (its queues' models), enough to fill a batch while every child is busy
    # (workers/batching/prefetch.py).
    prefetch_multiplier: int = 0
    # torch's intra-op threads in each pool child; 0: torch's default (every core). Fewer
    # trade throughput for latency on a host the model shares (bench/threads.py).
    cpu_threads: int = 0
    cuda_alloc_conf: str = "expandable_segments:True"
    cuda_memory_fraction: float = 0.0  # 0: no cap

    log_level: str = "INFO"
    log_format: str = "text"  # or json: one JSON object a line, for log shippers
    # The worker's Prometheus endpoint, served by its main process, and the webhook
    # deliverer's, both on worker_metrics_host (0: off).
    worker_metrics_port: int = 9808
    worker_metrics_host: str = "127.0.0.1"
    webhook_metrics_port: int = 9809
    # GPUs on a worker's host; -1: ask nvidia-smi (a separate process, so that the worker's
    # parent never initialises CUDA). `children_per_gpu` pool children per GPU (a CPU-only
    # host: one child): a second child runs its batch's host work (start, preparation,
    # storing, reporting) while the other's batch is on the device (bench/README.md, "Keeping
    # the device busy"). Each child holds its own copy of the models; the memory cap of each
    # (memory_fraction, cuda_memory_fraction) is split between a device's children.
    gpu_count: int = -1
    children_per_gpu: int = 1
    # Batches the main process hands each pool child ahead of the one it runs (0: none, a
    # child is handed its next batch only once the last returned): the next waits in the
    # child's pipe and starts the moment the last leaves the device. Only a full batch goes
    # ahead (max_batch_size), and only as the running batch nears its end (its model's usual
    # time less a quarter and 5 ms: a job of higher priority arriving before then still goes
    # first); none before a model is timed, nor while a reload replaces children.
    batches_ahead: int = 1
    # A model on a GPU whose models-file entry leaves max_batch_size out takes the calibrator's
    # answer (`python -m scripts.calibrate MODEL --save` writes it to calibration_file; a
    # relative path is taken from the models file's folder), capped for a text model at
    # max_batch_tokens / its max sequence length (text-embeddings-inference's
    # max-batch-tokens). On a CPU, or with no answer saved, max_batch_size's default (32).
    calibration_file: str = "calibration.json"
    max_batch_tokens: int = 16384
    # The models a worker's pool children load at start, comma-separated; empty: those of the
    # queues the worker consumes (the worker sets it for its children).
    worker_models: str = ""
    # Task events (Flower, `celery events`) show a job's summary (model, input count, size,
    # trace id), not its inputs; true restores the full arguments, for debugging.
    events_full_args: bool = False

    def __repr__(self) -> str:
        """Every setting but the secrets: what Celery's `inspect conf` and Flower show of the
        settings the Celery app carries (tasks/celery_app.py)."""
        shown = ", ".join(f"{f.name}={_shown(f.name, getattr(self, f.name))!r}"
                          for f in fields(self))
        return f"Settings({shown})"

    @property
    def sentinel_hosts(self) -> list[tuple[str, int]]:
        """The sentinels as (host, port); empty without Sentinel."""
        return [_host_port("redis_sentinels", entry)
                for entry in self.redis_sentinels.split(",") if entry.strip()]

    @property
    def redis_group_urls(self) -> dict[str, str]:
        """redis_groups as {name: url} (checked when the settings are loaded)."""
        return parse_groups(self.redis_groups)

    @property
    def wait_replicas(self) -> int:
        """How many replicas a submit waits for (redis_wait_replicas, -1 resolved)."""
        if self.redis_wait_replicas >= 0:
            return self.redis_wait_replicas
        return 1 if self.redis_sentinels.strip() else 0

    @property
    def kept_s(self) -> int:
        """How long a job that did not succeed keeps its request: kept_inputs_ttl_s, within
        the record's own life (job_ttl_s)."""
        return min(self.kept_inputs_ttl_s, self.job_ttl_s)

    @property
    def webhook_allow_list(self) -> list[str]:
        return [h.strip() for h in self.webhook_allow.split(",") if h.strip()]

    @property
    def image_url_allow_list(self) -> list[str]:
        return [h.strip() for h in self.image_url_allow.split(",") if h.strip()]

    @property
    def decoders_per_key(self) -> int:
        return self.image_decoders_per_key or max(1, self.image_decoders // 2)


def _shown(name: str, value: Any) -> Any:
    if name in SECRET_SETTINGS:
        return "**" if value else ""
    if name == "redis_groups":
        return shown_groups(value)
    if name == "redis_url":
        return shown_url(value)
    return value


def _host_port(name: str, entry: str) -> tuple[str, int]:
    """`host:port` (`[v6 address]:port`) as (host, port), or ConfigError naming `name`."""
    host, _, port = entry.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{name} must list host:port entries, comma-separated, got "
                          f"{entry.strip()!r}")
    return host, int(port)


# Settings never shown (Settings.__repr__), beside the password in redis_url.
SECRET_SETTINGS = frozenset({"webhook_secret", "redis_sentinel_password"})

# Environment variable → field. REDIS_URL is the one name every Redis user already knows; the
# rest carry the IQ_ prefix so they cannot collide with other software's.
ENV_NAMES: dict[str, str] = {"REDIS_URL": "redis_url"}
ENV_NAMES.update({f"IQ_{f.name.upper()}": f.name for f in fields(Settings)
                  if f.name != "redis_url"})

# IQ_ variables that something other than Settings reads, each with where: accepted beside the
# settings' own, so that an IQ_ variable nobody reads (a typo) stops the process instead of
# being silently ignored. docs/configuration.md's "Process settings" documents the launchers'.
OTHER_VARIABLES: dict[str, str] = {
    "IQ_CONFIG": "load_settings: the YAML settings file",
    "IQ_HOST": "scripts/web.sh, scripts/run.py",
    "IQ_PORT": "scripts/web.sh, scripts/run.py; the client's default: "
               "client/inference_queue_client/environment.py",
    "IQ_WEB_WORKERS": "gunicorn.conf.py",
    "IQ_WORKER_CONCURRENCY": "scripts/worker.sh",
    "IQ_WORKER_QUEUES": "scripts/worker.sh",
    "IQ_WORKER_NAME": "scripts/worker.sh",
    "IQ_WEBHOOK_CONCURRENCY": "scripts/webhooks.sh",
    "IQ_VAR_DIR": "scripts/run.py, scripts/redis-server.sh",
    "IQ_REDIS_DIR": "scripts/run.py, scripts/redis-server.sh",
    "IQ_REDIS_PASSWORD_FILE": "scripts/run.py, scripts/redis-server.sh",
    "IQ_REDIS_APP_PASSWORD_FILE": "scripts/run.py, scripts/redis-server.sh",
    "IQ_REDIS_APP_USER": "scripts/run.py, scripts/redis-server.sh",
    "IQ_RESPAWN_LAST_EXIT": "scripts/respawn.py sets it, scripts/redis-server.sh reads it",
    "IQ_API_URL": "client/inference_queue_client/environment.py",
    "IQ_API_KEY": "client/inference_queue_client/environment.py",
}
KNOWN_VARIABLES = frozenset(ENV_NAMES) | frozenset(OTHER_VARIABLES)
# prometheus_client's own variable: its multiprocess files' folder (check_metrics_folder).
METRICS_FOLDER_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One line for each IQ_ variable in `environ` that nothing reads, naming the closest
    known one."""
    lines = []
    for name in sorted(n for n in environ if n.startswith("IQ_") and n not in KNOWN_VARIABLES):
        close = difflib.get_close_matches(name, KNOWN_VARIABLES, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "no setting has a name like it"
        lines.append(f"unknown environment variable {name}: {hint}")
    return lines


def check_metrics_folder(environ: Mapping[str, str] | None = None) -> None:
    """ConfigError when PROMETHEUS_MULTIPROC_DIR names a folder this process cannot write its
    metrics in. prometheus_client writes each process's counters there (the API's processes,
    a worker's children): set to a folder that is missing or not this user's to write, the
    API's processes failed at their first counter and a worker served with no /metrics,
    neither naming the variable; set but empty, it writes them in the working folder.
    Unset, the API and each worker make a fresh folder of their own (gunicorn.conf.py,
    workers/spawn.py).

    Called once, where an operator's value comes in: the API's master as it starts
    (gunicorn's on_starting: not at each SIGHUP's re-read of its settings, which must not
    stop a serving API) and a worker's main process. Not in the processes they start, which
    inherit a folder already checked or made: a pool child refused there, when a cleaner of
    /tmp had removed its worker's folder, would be started again and again. (The deliverer
    and Flower keep their metrics in memory and ignore the variable; make run, which runs
    every program, refuses it: scripts/run.py.)"""
    environ = os.environ if environ is None else environ
    folder = environ.get(METRICS_FOLDER_VARIABLE)
    if folder is None:
        return
    if not folder:
        why = "is empty"
    elif not os.path.isdir(folder):
        why = "does not exist" if not os.path.lexists(folder) else "is not a folder"
    elif not os.access(folder, os.W_OK | os.X_OK):
        why = "is a folder this process cannot write to"
    else:
        return
    raise ConfigError(f"{METRICS_FOLDER_VARIABLE} {folder!r} {why} (each process's metrics are "
                      f"written there; unset, the API and each worker make a folder of their "
                      f"own)")


def start_unless_metrics_folder_fails(program: str) -> None:
    """check_metrics_folder at a program's start, its refusal one line (SystemExit), as the
    program's other reasons not to start are."""
    try:
        check_metrics_folder()
    except ConfigError as exc:
        raise SystemExit(f"{program} will not start: {exc}") from None


def _coerce(name: str, raw: Any, kind: type) -> Any:
    try:
        if kind is bool:
            return str(raw).lower() in {"1", "true", "yes", "on"}
        return kind(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be {kind.__name__}, got {raw!r}") from None


def _from_file(config_file: str, types: Mapping[str, type]) -> dict[str, Any]:
    """The settings the YAML file IQ_CONFIG names. One line naming IQ_CONFIG and the path for
    a file that cannot be read or parsed; refused when it holds a secret and other users may
    read it (as a file others may write is refused: scripts/preflight.py)."""
    try:
        with open(config_file, "rb") as f:  # a folder: IsADirectoryError
            mode, text = os.fstat(f.fileno()).st_mode & 0o777, f.read()
        data = yaml.safe_load(text) or {}
    except OSError as exc:
        raise ConfigError(f"IQ_CONFIG {config_file}: cannot be read "
                          f"({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"IQ_CONFIG {config_file}: not YAML ({' '.join(str(exc).split())})") \
            from None
    if not isinstance(data, dict):
        raise ConfigError(f"{config_file}: expected a mapping at the top level")
    values = {}
    for key, raw in data.items():
        if key not in types:
            raise ConfigError(f"{config_file}: unknown setting {key!r}")
        values[key] = _coerce(key, groups_text(raw) if key == "redis_groups" else raw,
                              types[key])
    secrets = _secrets_in(values)
    if secrets and mode & 0o044:
        raise ConfigError(f"IQ_CONFIG {config_file} holds {', '.join(secrets)} and other users "
                          f"may read it (mode {mode:04o}): chmod 600 {config_file}")
    return values


def _secrets_in(values: Mapping[str, Any]) -> list[str]:
    """The settings among `values` that hold a secret: a password or the webhooks' key."""
    found = [key for key in ("webhook_secret", "redis_sentinel_password") if values.get(key)]
    if values.get("redis_url") and _has_password(values["redis_url"]):
        found.append("redis_url (its password)")
    if values.get("redis_groups"):
        try:
            groups = parse_groups(values["redis_groups"])
        except ConfigError:
            groups = {}  # named by the check after this
        found += [f"redis_groups.{name} (its password)" for name, url in groups.items()
                  if _has_password(url)]
    return found


def _has_password(url: str) -> bool:
    try:
        return bool(urlsplit(url).password)
    except ValueError:
        return False


def _from_environ(environ: Mapping[str, str], types: Mapping[str, type]) -> dict[str, Any]:
    """The settings the environment sets (an empty variable sets nothing)."""
    return {key: _coerce(env_name, environ[env_name], types[key])
            for env_name, key in ENV_NAMES.items()
            if env_name in environ and environ[env_name] != ""}


def _from_overrides(overrides: Mapping[str, Any], types: Mapping[str, type]) -> dict[str, Any]:
    values = {}
    for key, raw in overrides.items():
        if key not in types:
            raise ConfigError(f"unknown setting {key!r}")
        values[key] = _coerce(key, groups_text(raw) if key == "redis_groups" else raw,
                              types[key])
    return values


def load_settings(
    overrides: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build Settings: defaults, then the YAML file named by IQ_CONFIG (if any), then the
    environment, then `overrides` (tests pass theirs here)."""
    environ = os.environ if environ is None else environ
    unknown = unknown_variables(environ)
    if unknown:
        raise ConfigError("\n".join(unknown + ["(docs/configuration.md lists every variable)"]))
    types = {f.name: type(f.default) for f in fields(Settings)}
    values: dict[str, Any] = {}
    if environ.get("IQ_CONFIG"):
        values.update(_from_file(environ["IQ_CONFIG"], types))
    values.update(_from_environ(environ, types))
    values.update(_from_overrides(overrides or {}, types))
    settings = dataclasses.replace(Settings(), **values)
    check(settings)
    parse_groups(settings.redis_groups)
    return settings
