"""The API's hand-over across a graceful reload (SIGHUP: a models reload's, app/reloading.py, or
an operator's), which gunicorn.conf.py's hooks drive and the Worker (web/worker.py) waits on.

gunicorn's master starts the new processes and at once tells the old ones to stop (SIGTERM), on
which they stop accepting within a second; the new ones accept only once they have imported and
built the app, seconds on a loaded host: nothing accepted meanwhile, and every request sent then
waited in the listen queue (3.3 s with two API processes on a loaded two-core machine, 5.9 s
once). Instead the master notes, on a reload, the age gunicorn gives the first new process
(`note_reload`, from `on_reload`); each process says it is up once its app is built
(`note_up`, from `post_worker_init`), its entry gone when it exits (`note_gone`, from
`child_exit`); an old process told to stop goes on accepting until as many new ones are up as
gunicorn runs, or the master's `timeout` passed (the master kills a new process not up by
then), then stops as before (Worker). A stop of the whole gunicorn, no reload since the process
started, is not delayed. The entries are files in a folder of the master's own, which its
processes inherit: `reload` holds the age, `up-<age>-<pid>` one per process up. A stop of the
master (SIGTERM, SIGINT, SIGQUIT) ends the wait: gunicorn's master handles it only once the old
processes are gone (it waits for them in its reload), so its handler (`stop_noted`, installed
by `when_ready`) first writes `stop`, the signal's number; an old process sees it and stops as
that signal says (SIGTERM: it finishes what it holds), and a new one that lost the master's
signal before it set its own handlers stops too (Worker).
"""
from __future__ import annotations

import os
import shutil
import tempfile

FOLDER, _OWN_FOLDER = "_IQ_API_HANDOVER_DIR", "iq-api-handover-"
LOST_STOP = "_IQ_API_LOST_STOP"  # a reload's SIGTERM to a process before it set its handlers


def own_folder() -> None:
    """The master's folder, made as gunicorn.conf.py is read unless this master made it (a
    SIGHUP reads the file again in the same master); a master exec'd by a USR2 makes its own."""
    folder = os.environ.get(FOLDER, "")
    if not os.path.basename(folder).startswith(f"{_OWN_FOLDER}{os.getpid()}-"):
        os.environ[FOLDER] = tempfile.mkdtemp(prefix=f"{_OWN_FOLDER}{os.getpid()}-")


def remove_folder() -> None:
    shutil.rmtree(os.environ[FOLDER], ignore_errors=True)


def _up_entry(worker) -> str:
    return os.path.join(os.environ[FOLDER], f"up-{worker.age}-{worker.pid}")


def note_reload(first_age: int) -> None:
    """A reload: `first_age`, the age of its first new process."""
    folder = os.environ[FOLDER]
    staged = os.path.join(folder, ".reload")
    with open(staged, "w") as out:
        out.write(str(first_age))
    os.replace(staged, os.path.join(folder, "reload"))


def note_up(worker) -> None:
    open(_up_entry(worker), "w").close()


def stop_noted(master, handler, sig, frame):
    """The master's handler of a stop: `stop` written, then gunicorn's own (which queues it).
    A process gunicorn forks holds it until it sets its own: what it gets meanwhile is a
    reload's SIGTERM (a second reload, or one while a killed process's replacement boots), for
    it alone, kept for it (Worker.init_signals). Noted as the master's stop, it had every
    process started since exit as it booted, nothing serving until gunicorn was restarted."""
    if os.getpid() != master:
        os.environ[LOST_STOP] = str(int(sig))
        return
    folder = os.environ[FOLDER]
    staged = os.path.join(folder, ".stop")
    try:
        with open(staged, "w") as out:
            out.write(str(int(sig)))
        os.replace(staged, os.path.join(folder, "stop"))
    except OSError:
        pass  # the folder gone (the master exiting): nothing waits on it
    handler(sig, frame)


def _noted(name: str) -> int | None:
    """The number the master noted in its folder's file `name`, or None (none noted)."""
    try:
        with open(os.path.join(os.environ.get(FOLDER, ""), name)) as found:
            return int(found.read())
    except (OSError, ValueError):
        return None


def stopping() -> int | None:
    """The stop the master was told (a signal's number), or None."""
    return _noted("stop")


def _reload_age() -> int | None:
    """The age of the last reload's first process; None: no reload since the master started."""
    return _noted("reload")


def replaced(age: int, processes: int) -> bool:
    """Whether the process of `age`, told to stop, may stop accepting now: no reload since it
    started (a stop), the master told to stop, or `processes` processes of the last reload
    are up."""
    folder, first = os.environ.get(FOLDER, ""), _reload_age()
    if stopping() is not None or first is None or first <= age:
        return True
    ups = [name.split("-") for name in os.listdir(folder) if name.startswith("up-")]
    return sum(1 for _up, entry_age, _pid in ups if int(entry_age) >= first) >= processes


def note_gone(server, worker) -> None:
    """A process exited: its entry removed, and if it was one of the last reload's while older
    ones hand over, its replacement started (`_replace_in_hand_over`)."""
    try:
        os.unlink(_up_entry(worker))
    except FileNotFoundError:
        pass  # it exited before its app was built
    _replace_in_hand_over(server, worker)


def _replace_in_hand_over(server, worker):
    """A process of the last reload gone (a SIGKILL, a crash, the master's `timeout`) while
    older ones hand over: gunicorn's master (reaping, in its reload, while it waits for the old
    ones to exit) starts another only once fewer processes run than it should, which the older
    ones, accepting until as many new ones are up, never let happen. They held on for
    `timeout`, then left together, and with one process nothing accepted while its replacement
    booted. Its replacement is started now; not once gunicorn is told to stop."""
    first = _reload_age()
    if first is None or worker.age < first or not server.LISTENERS or \
            stopping() is not None:
        return
    ages = [other.age for other in server.WORKERS.values()]
    if any(age < first for age in ages) and \
            sum(1 for age in ages if age >= first) < server.num_workers:
        server.log.info("API process %s of the reload gone before its elders left: "
                        "its replacement started", worker.pid)
        server.spawn_worker()
