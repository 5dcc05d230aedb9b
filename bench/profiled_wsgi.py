"""The API's WSGI app (app/wsgi.py) with cProfile switched on and off by a signal
(bench/profwrap.py's TOGGLE; the stats dumped to `BENCH_PROFILE_OUT`), for `bench.api_profile`:
`gunicorn bench.profiled_wsgi:app`. Greenlets switch inside one thread, so cProfile's times
are muddled and inflated; its call counts are exact."""
from __future__ import annotations

import cProfile
import os
import signal

from app.wsgi import app  # noqa: F401  (what gunicorn serves)
from bench.profwrap import TOGGLE

_prof = cProfile.Profile()
_on = [False]


def _toggle(_signum, _frame) -> None:
    if _on[0]:
        _prof.disable()
        _prof.dump_stats(os.environ["BENCH_PROFILE_OUT"])
    else:
        _prof.enable()
    _on[0] = not _on[0]


signal.signal(TOGGLE, _toggle)
