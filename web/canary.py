"""The canary of the web server's code on disk, beside a models reload's (app/canary.py runs
both): a reload ends in a SIGHUP to gunicorn's master, which reads gunicorn.conf.py again and
imports web/ anew from disk (the loop at the top of gunicorn.conf.py); a file there that does
not load (a half-finished deploy) has the master print "Failed to read config file" and exit,
its processes with it: the API down. So, in a process of its own, in the folder the master
runs in (the API process's own):

    python -m web.canary [CONFIG]

gunicorn.conf.py (or CONFIG) compiled, not run (its body makes folders and raises the file
limit: the master's to do); every module of web/ imported (web.worker imports gunicorn's gevent
worker, which patches nothing until a worker process starts); each name gunicorn.conf.py
imports from web/ there. Exit 0, or one line on stdout naming the file and the error, exit 1.
"""
from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import sys
import traceback

CONFIG = "gunicorn.conf.py"  # what gunicorn's master reads in its folder without `-c`


def _line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _where(exc: BaseException, folder: str) -> str:
    """The file of web/ the error is in (the innermost such frame; a SyntaxError's own file),
    relative to the current folder."""
    files = [frame.filename for frame in traceback.extract_tb(exc.__traceback__)]
    if isinstance(exc, SyntaxError) and exc.filename:
        files.append(exc.filename)
    ours = [name for name in files if os.path.abspath(name).startswith(folder + os.sep)]
    return os.path.relpath(ours[-1]) if ours else folder


def _web_imports(tree: ast.AST) -> list[tuple[str, str]]:
    """(module, name) of each `from web... import name` in gunicorn.conf.py."""
    return [(node.module, alias.name) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
            and (node.module == "web" or node.module.startswith("web."))
            for alias in node.names if alias.name != "*"]


def check(config: str = CONFIG) -> str:
    """Why what gunicorn's master would read at a SIGHUP does not load; "" when it does."""
    try:
        with open(config, "rb") as file:
            tree = compile(file.read(), config, "exec", ast.PyCF_ONLY_AST)
        compile(tree, config, "exec")
    except (OSError, SyntaxError, ValueError) as exc:
        return f"{config} does not load: {_line(exc)}"
    import web

    folder = os.path.abspath(os.path.dirname(web.__file__))
    names = ["web"] + [f"web.{info.name}" for info in pkgutil.iter_modules([folder])
                       if info.name != "canary"]
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - any failure to import is the answer
            return f"{_where(exc, folder)} does not load: {_line(exc)}"
    for module, name in _web_imports(tree):
        if not hasattr(sys.modules.get(module), name):
            return f"{config} does not load: ImportError: cannot import name {name!r} " \
                   f"from {module!r}"
    return ""


def main(argv: list[str]) -> int:
    why = check(*argv[1:2])
    if why:
        print(why, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
