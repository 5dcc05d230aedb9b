"""Loaded by `site` at start-up when this folder is on PYTHONPATH (tests/support/requirements.py
puts it there): a top-level module found under one of the guarded folders (site-packages, the
project) that is not on IMPORT_GUARD's allowed list is refused with ImportError, as if it
were not installed; each refusal is logged on stderr. The standard library is never guarded."""
import importlib.abc
import importlib.machinery
import json
import os
import sys


class ImportGuard(importlib.abc.MetaPathFinder):
    def __init__(self, allowed: set, guarded: list) -> None:
        self.allowed, self.guarded = allowed, tuple(guarded)

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in self.allowed or top in sys.modules:
            return None
        found = importlib.machinery.PathFinder.find_spec(top)
        where = found and (found.origin or next(iter(found.submodule_search_locations or []),
                                                ""))
        if where and where.startswith(self.guarded):
            print(f"import guard: refused {top}", file=sys.stderr, flush=True)
            raise ImportError(f"No module named {top!r} (not in the requirements)", name=top)
        return None


with open(os.environ["IMPORT_GUARD"]) as _file:
    _config = json.load(_file)
sys.meta_path.insert(0, ImportGuard(set(_config["allowed"]), _config["guarded"]))
print(f"import guard: on, {len(_config['allowed'])} top-level modules allowed", file=sys.stderr,
      flush=True)
