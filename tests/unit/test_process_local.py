"""config/process.py: the pid and random bytes a process keeps rather than asks the kernel for
at each job, set anew in a forked child."""
from __future__ import annotations

import dis
import os
import sys
import threading

import pytest

from config import process
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
            os.write(write, bytes([pid() == os.getpid()]) + random_bytes(16))
        finally:
            os._exit(0)
    os.close(write)
    got = os.read(read, 32)
    os.waitpid(child, 0)
    os.close(read)
    assert got[0] == 1 and pid() == os.getpid() != child
    assert got[1:] != random_bytes(16)  # what the parent draws next is not what the child drew


def _drawn_by_two_threads(switch_at: int) -> tuple[bytes, bytes, bool]:
    """What this thread and another draw when this one is stopped at the bytecode offset
    `switch_at` of `random_bytes` (the first time it gets there) while the other draws."""
    paused, resume = threading.Event(), threading.Event()
    first = threading.current_thread()

    def tracer(frame, event, arg):
        if frame.f_code is not process.random_bytes.__code__:
            return None
        frame.f_trace_opcodes = True
        if event == "opcode" and frame.f_lasti == switch_at and \
                threading.current_thread() is first and not paused.is_set():
            paused.set()
            resume.wait(10)
        return tracer

    got: dict[str, bytes] = {}

    def other() -> None:
        paused.wait(10)
        got["other"] = random_bytes(16)
        resume.set()

    thread = threading.Thread(target=other)
    thread.start()
    sys.settrace(tracer)
    try:
        got["first"] = random_bytes(16)
    finally:
        sys.settrace(None)
        resume.set()
        paused.set()
        thread.join(10)
    return got["first"], got["other"], paused.is_set()


@pytest.mark.parametrize("block", ["in hand", "used up"])
def test_two_threads_never_get_the_same_bytes_wherever_one_is_switched_out(block):
    """The webhook deliverer's pool is threads, each minting delivery tags: wherever in
    `random_bytes` one thread is stopped while another draws (the block in hand, or used up so
    that both draw a new one), the two get different bytes."""
    offsets = [i.offset for i in dis.get_instructions(process.random_bytes)]
    switched = 0
    for offset in offsets:
        if block == "in hand":
            random_bytes(16)
        else:
            process._block = (b"", process._block[1])  # the next draw finds it used up
        first, other, paused = _drawn_by_two_threads(offset)
        switched += paused
        assert first != other, f"the same bytes with a switch at offset {offset}"
    assert switched > len(offsets) // 2  # most offsets were reached and switched at
