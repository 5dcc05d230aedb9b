"""Counting the Python calls a piece of code makes: the tests that hold a cut of calls a
request (issue 40) to what it removed."""
from __future__ import annotations

import sys
from typing import Callable


def calls(call: Callable[[], object], where: str, name: str | None = None,
          caller: str | None = None) -> int:
    """How many functions of a file ending in `where` (of that `name`, called from a function
    named `caller`, where given) were called while `call` ran."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        code = frame.f_code
        if event == "call" and code.co_filename.endswith(where) \
                and name in (None, code.co_name) \
                and (caller is None or frame.f_back.f_code.co_name == caller):
            count += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return count
