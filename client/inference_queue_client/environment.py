"""The client's environment variables, read as the stack sets them: `IQ_API_URL` (where the
API is), else `IQ_PORT` (the port `make run` gives the API on this host), else
http://127.0.0.1:8000; `IQ_API_KEY`. A misspelling of one of them is refused, naming the
closest (unknown environment variable IQ_API_UR: did you mean IQ_API_URL?), as the servers
refuse theirs, rather than silently falling back to the default address, where another stack
may be listening."""
from __future__ import annotations

import difflib
from typing import Mapping

from inference_queue_client.errors import ConfigurationError

URL, KEY, PORT = "IQ_API_URL", "IQ_API_KEY", "IQ_PORT"
VARIABLES = (URL, KEY, PORT)
# Close enough to one of the client's names to be a slip of it, and far from every variable
# the stack's processes read (tests/unit/test_client.py checks them against config/).
CUTOFF = 0.8


def misspellings(environ: Mapping[str, str], names: tuple[str, ...] = VARIABLES) -> list[str]:
    """One line for each IQ_ variable of `environ` that looks like a misspelling of one of
    `names` (the variables the caller would read)."""
    lines = []
    for name in sorted(n for n in environ if n.startswith("IQ_") and n not in VARIABLES):
        close = difflib.get_close_matches(name, names, n=1, cutoff=CUTOFF)
        if close:
            lines.append(f"unknown environment variable {name}: did you mean {close[0]}?")
    return lines


def api_url(environ: Mapping[str, str]) -> str:
    """The API's URL: IQ_API_URL, else the API of a stack on this host at IQ_PORT, else
    http://127.0.0.1:8000 (make run's default)."""
    _refuse(misspellings(environ, (URL, PORT)))
    if environ.get(URL):
        return environ[URL]
    port = environ.get(PORT, "") or "8000"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigurationError(f"{PORT} must be a port number (1-65535), got {port!r}")
    return f"http://127.0.0.1:{int(port)}"


def api_key(environ: Mapping[str, str]) -> str | None:
    _refuse(misspellings(environ, (KEY,)))
    return environ.get(KEY) or None


def _refuse(lines: list[str]) -> None:
    if lines:
        raise ConfigurationError("; ".join(lines))
