"""A models file parsed by a process of the worker's user, for make run and make reload run as
root with IQ_RUN_USERS=separate: its `kinds:` modules (config/kinds.py) are code the operator
names, and no root process imports them (as the keepers check a part as its user:
scripts/respawn.py `checked_as`).

`as_user(user)` is what config.models.parse_elsewhere takes: each parse runs
`python -m scripts.models_as_user` as that user, the file's path and bytes on its stdin; it
answers the models as JSON, and the kinds they name (their data, never their code: a kind's
`parse` ran there), which root then knows by name (`config.kinds.register`), or the one-line
ConfigError the parse raised. Root keeps what needs no operator code: reading the file's
bytes, and every check of who may write what (scripts/preflight.py).
"""
from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from config import ConfigError, ModelSpec
from config import Settings
from config.kinds import Kind, kind_names, kind_of, register
from config.models import parse_elsewhere, parse_models
from config.preprocess import ImagePreprocess
from scripts.processes import ROOT
from scripts.run_users import USERS, switch

# What the parse's process is not handed of root's environment: the secrets (scripts/run.py).
SECRETS = ("REDIS_URL", "IQ_REDIS_SENTINEL_PASSWORD", "IQ_REDIS_PASSWORD_FILE",
           "IQ_REDIS_APP_PASSWORD_FILE", "FLOWER_BASIC_AUTH", "IQ_WEBHOOK_SECRET",
           "IQ_REDIS_GROUPS", "IQ_API_KEYS_FILE")
_KIND_DATA = ("name", "input", "handler", "keys", "options", "vectors", "quantizable",
              "archive", "description")
_TUPLES = ("labels", "input_shape", "options")


@contextmanager
def kinds_as_worker(settings: Settings, env: dict[str, str] | None = None) -> Iterator[None]:
    """Within it, with IQ_RUN_USERS=separate as root, every parse_models of this process (that
    imports kinds) is done as the worker's user (`as_user`); else here, as before."""
    if settings.run_users != "separate" or os.geteuid() != 0:
        yield
        return
    parse_elsewhere(as_user(USERS["worker"], env))
    try:
        yield
    finally:
        parse_elsewhere(None)


def as_user(user: str, env: dict[str, str] | None = None
            ) -> Callable[[Path, bytes], dict[str, ModelSpec]]:
    """parse_models, done by a process of `user` (its groups too), each file once."""
    known: dict[tuple[str, bytes], dict[str, ModelSpec]] = {}
    own_env = {k: v for k, v in (os.environ if env is None else env).items()
               if k not in SECRETS}

    def parse(path: Path, content: bytes) -> dict[str, ModelSpec]:
        where = str(Path(os.path.abspath(path)))
        if (where, content) not in known:
            known[where, content] = _parsed(user, own_env, where, content)
        return known[where, content]

    return parse


def _parsed(user: str, env: dict[str, str], path: str, content: bytes) -> dict[str, ModelSpec]:
    ask = json.dumps({"path": path, "content": base64.b64encode(content).decode()})
    try:
        answer = subprocess.run([sys.executable, "-m", "scripts.models_as_user"], input=ask,
                                env=env, cwd=ROOT, capture_output=True, text=True,
                                **switch(user))  # type: ignore[arg-type]
    except OSError as exc:  # this Python is not theirs to run (scripts/run_users.py says why)
        raise ConfigError(f"{path}: the models file's check as {user} could not start: "
                          f"{exc}") from None
    try:
        told = json.loads(answer.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):  # it could not even parse: its last words are why
        last = (answer.stderr.strip().splitlines()
                or [f"exited with code {answer.returncode}"])[-1]
        raise ConfigError(f"{path}: the models file's check as {user} failed: {last}") \
            from None
    if "error" in told:
        raise ConfigError(told["error"])
    for kind in told["kinds"]:
        if kind["name"] not in kind_names():  # an operator's: its data, known by its name
            register(Kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in kind.items()}))
    return {name: _spec(values) for name, values in told["models"].items()}


def _spec(values: dict[str, Any]) -> ModelSpec:
    values = {k: tuple(v) if k in _TUPLES else v for k, v in values.items()}
    if values.get("preprocess"):
        values["preprocess"] = ImagePreprocess(**{
            k: tuple(v) if isinstance(v, list) else v
            for k, v in values["preprocess"].items()})
    return ModelSpec(**values)


def _answer(path: Path, content: bytes) -> dict[str, Any]:
    try:
        models = parse_models(path, content)
    except ConfigError as exc:
        return {"error": str(exc).splitlines()[0]}
    kinds = {spec.kind: kind_of(spec.kind) for spec in models.values()}
    return {"models": {name: dataclasses.asdict(spec) for name, spec in models.items()},
            "kinds": [{k: getattr(kind, k) for k in _KIND_DATA} for kind in kinds.values()]}


def main() -> int:
    asked = json.loads(sys.stdin.read())
    print(json.dumps(_answer(Path(asked["path"]), base64.b64decode(asked["content"])),
                     default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
