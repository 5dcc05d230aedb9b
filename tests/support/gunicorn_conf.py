"""gunicorn.conf.py loaded as gunicorn loads it (its names: the API's worker, parser and answer
classes), with the environment it sets for its processes put back afterwards."""
from __future__ import annotations

import os
import runpy

from scripts.processes import ROOT


def load_gunicorn_conf() -> dict:
    kept = {name: os.environ.get(name) for name in ("PROMETHEUS_MULTIPROC_DIR",
                                                   "_IQ_API_HANDOVER_DIR")}
    loaded = runpy.run_path(str(ROOT / "gunicorn.conf.py"))
    for name, value in kept.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return loaded
