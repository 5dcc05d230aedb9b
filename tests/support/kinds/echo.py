"""The `echo` kind: a text model that answers each input repeated `times` times, separated by
`sep`. Registered when a models file lists this module under `kinds:`; its handler is named,
not imported, so that the API never loads it."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from config.checks import ConfigError
from config.kinds import Kind, register
from config.values import positive_int


def parse(where: str, raw: Mapping[str, Any], base: Path) -> dict[str, Any]:
    sep = raw.get("sep", " ")
    if not isinstance(sep, str):
        raise ConfigError(f"{where}: sep must be a string, got {sep!r}")
    return {"times": positive_int(where, "times", raw.get("times", 1)), "sep": sep}


ECHO = register(Kind("echo", "text", "tests.support.kinds.echo_handler:EchoHandler", parse,
                     keys=("times", "sep"), description="each text, repeated `times` times"))
