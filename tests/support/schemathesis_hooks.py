"""schemathesis hooks for tests/faults/test_openapi.py (loaded through the config file's
`hooks`), each the answer to a limit of the tool rather than a change to what it checks."""
from __future__ import annotations

from typing import Any

import schemathesis

# Models whose batches take seconds (tests/conftest.py): a run that queued dozens of their jobs
# would spend minutes on held requests and event streams. The fuzz test (test_fuzz.py) sends
# them generated jobs.
SLOW_MODELS = frozenset({"sleepy", "patient"})


@schemathesis.hook
def before_load_schema(context: Any, raw_schema: dict) -> None:
    """schemathesis 4.32 reads a request header named `*-ID` as the id of a resource that
    must exist first (`X-Request-ID` as an "XRequest"), so it would never start a stateful
    scenario from a submit, the one operation that makes jobs. The header is free text the
    API adopts or replaces (the document says so); the copy the tool tests goes without it."""
    for item in raw_schema.get("paths", {}).values():
        for operation in item.values():
            if isinstance(operation, dict) and "parameters" in operation:
                operation["parameters"] = [p for p in operation["parameters"]
                                           if p.get("name") != "X-Request-ID"]


@schemathesis.hook
def filter_body(context: Any, body: Any) -> bool:
    return not (isinstance(body, dict) and body.get("model") in SLOW_MODELS)
