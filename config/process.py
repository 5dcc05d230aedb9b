"""What a process would otherwise ask the kernel for at each job, kept in the process: its
id, and random bytes. Both are set anew in a forked child (`os.register_at_fork`) before any
code of the child runs, so that a child never sees its parent's id nor draws its parent's
bytes.

Each is a system call otherwise: the API asked for its pid five times a job (prometheus_client
checks it at each counter write, Celery's message origin) and for random bytes four times (a
job id, a trace id, the record's token, a message's delivery tag), ~0.5 and ~1.2 µs each."""
from __future__ import annotations

import itertools
import os

_SLOT = 16  # bytes a call may take from the block: a uuid4's
_BLOCK = 4096  # random bytes drawn from the kernel at once: 256 slots

_pid = os.getpid()
# The block drawn, and the count that hands out its slots, replaced together (one tuple). The
# count's `next` is one step of C that no other thread can enter halfway, so no two calls,
# in any threads (the deliverer's pool is threads), ever get the same slot of one block: no
# lock is needed, which under gevent would be gevent's, Python code at each draw.
_block: tuple[bytes, itertools.count] = (b"", itertools.count())


def pid() -> int:
    """`os.getpid()`, without the system call."""
    return _pid


def random_bytes(size: int) -> bytes:
    """`os.urandom(size)`: bytes of the kernel's random source (getrandom), drawn a block at a
    time, each slot of it handed out once."""
    global _block
    if size > _SLOT:
        return os.urandom(size)
    while True:
        pool, slots = _block
        at = next(slots) * _SLOT
        if at < len(pool):
            return pool[at:at + size]
        # Used up (or none yet): a new block, with a count of its own. Two threads here at
        # once each draw one, and each hands out its own block's slots once.
        _block = (os.urandom(_BLOCK), itertools.count())


def _forked() -> None:
    global _pid, _block
    _pid, _block = os.getpid(), (b"", itertools.count())


os.register_at_fork(after_in_child=_forked)
