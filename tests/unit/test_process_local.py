"""config/process.py: the pid and random bytes a process keeps rather than asks the kernel for
at each job, set anew in a forked child."""
from __future__ import annotations

import os

from config.process import pid, random_bytes


def test_random_bytes_are_never_handed_out_twice_and_come_in_any_size():
    drawn = [random_bytes(16) for _ in range(1000)]  # several blocks
    assert len(set(drawn)) == 1000 and {len(b) for b in drawn} == {16}
    assert len(random_bytes(6)) == 6 and len(random_bytes(10_000)) == 10_000
    assert random_bytes(0) == b""


def test_a_forked_child_has_its_own_pid_and_draws_other_bytes_than_its_parent():
    random_bytes(16)  # the parent holds a block
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.write(write, bytes([pid() == os.getpid()]) + random_bytes(32))
        finally:
            os._exit(0)
    os.close(write)
    got = os.read(read, 64)
    os.waitpid(child, 0)
    os.close(read)
    assert got[0] == 1 and pid() == os.getpid() != child
    assert got[1:] != random_bytes(32)  # what the parent draws next is not what the child drew
