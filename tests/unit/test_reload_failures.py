"""A failed load said in one line (tasks/reload_failures.py `one_line`): what `make reload`
reports, and what a worker whose pool child could not load its models exits with."""
from __future__ import annotations

import traceback

import pytest

from tasks.reload_failures import one_line


def raised(exc: BaseException, *notes: str) -> BaseException:
    try:
        try:
            raise exc
        except BaseException as caught:
            for note in notes:
                caught.add_note(note)
            raise
    except BaseException as caught:
        return caught


def test_a_load_failure_names_its_model_before_its_type_and_first_line():
    """The outside attack of session 13: a TorchScript model that raised at its warm-up was
    reported as the bare RuntimeError, no model named (workers/child/runtime.py notes it)."""
    exc = raised(RuntimeError("The following operation failed\n  in the interpreter"),
                 "model ts on cpu")
    assert one_line(exc) == "model ts on cpu: RuntimeError: The following operation failed"


@pytest.mark.parametrize("exc, said", [
    (KeyError(), "KeyError"),
    (ValueError("a\nb"), "ValueError: a"),
    (OSError(2, "No such file"), "FileNotFoundError: [Errno 2] No such file"),
])
def test_without_a_note_it_is_the_type_and_the_first_line(exc, said):
    assert one_line(raised(exc)) == said


def test_a_long_one_is_cut():
    said = one_line(raised(RuntimeError("x" * 1000), "model m on cuda:0"))
    assert said.startswith("model m on cuda:0: RuntimeError: x") and said.endswith("…")
    assert len(said) == 300


def test_a_long_note_leaves_room_for_the_error():
    """The outside attack of session 14: a 290-character model name filled the line."""
    said = one_line(raised(RuntimeError("boom"), f"model {'m' * 290} on cpu"))
    assert said.endswith("…: RuntimeError: boom")
    assert len(said) == 100 + len(": RuntimeError: boom")


def test_the_whole_message_in_one_line_and_a_message_that_cannot_be_made():
    """A worker's exit reason keeps the whole message (a TorchScript error's first line names
    no cause); the re-attack of session 14: an error whose __str__ raised raised again in the
    child's handler, which then never stopped its worker."""
    exc = raised(RuntimeError("The following operation failed\n  RuntimeError: boom"),
                 "model m")
    assert one_line(exc, whole=True) == \
        "model m: RuntimeError: The following operation failed RuntimeError: boom"

    class Unsayable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    assert one_line(raised(Unsayable(), "model m on cpu"), whole=True).startswith(
        "model m on cpu: ")


def test_control_characters_are_escaped():
    """The re-attack of session 14: a terminal's escape codes in a model's name reached make
    reload's answer as they were."""
    said = one_line(raised(RuntimeError("bad\x07 \x9b2Jend"), "model \x1b[2Jm on cpu"))
    assert said == "model \\x1b[2Jm on cpu: RuntimeError: bad\\x07 \\x9b2Jend"


def test_an_exception_groups_errors_are_each_said():
    """A load that raises a group (a kind's loader running its steps in a TaskGroup) is
    said by what it holds, each with its own notes, not only by how many."""
    inner = ValueError("bad weights\nat layer 3")
    inner.add_note("shard 2")
    group = ExceptionGroup("loading failed", [inner, OSError("disk gone")])
    group.add_note("model m on cpu")
    assert one_line(group) == ("model m on cpu: ExceptionGroup: loading failed (2 sub-exceptions)"
                               " [shard 2: ValueError: bad weights; OSError: disk gone]")
    nested = ExceptionGroup("outer", [ExceptionGroup("inner", [KeyError("k")])])
    assert one_line(nested, whole=True) == ("ExceptionGroup: outer (1 sub-exception) "
                                            "[ExceptionGroup: inner (1 sub-exception) "
                                            "[KeyError: 'k']]")


def test_a_group_too_large_or_too_deep_for_the_line_is_cut():
    wide = ExceptionGroup("many", [ValueError(f"error {i}") for i in range(1000)])
    deep: BaseException = KeyError("bottom")
    for level in range(5000):  # traceback's description of it: a RecursionError
        deep = ExceptionGroup(f"level {level}", [deep])
    for group in (wide, deep):
        line = one_line(group)
        assert len(line) <= 300 and "…" in line, line
    assert one_line(wide).startswith("ExceptionGroup: many (1000 sub-exceptions) [ValueError: "
                                     "error 0; ValueError: error 1; ")


def test_a_groups_errors_are_said_without_describing_all_of_them(monkeypatch):
    """A tree of 4**8 errors: each level's line was built from traceback's description of
    everything under it (over 10 s of CPU for a 300-character line); now only the errors
    the line has room for are described."""
    described = []
    real = traceback.TracebackException.__init__

    def counted(self, exc_type, exc_value, *args, **kwargs):
        described.append(exc_value)
        real(self, exc_type, exc_value, *args, **kwargs)

    monkeypatch.setattr(traceback.TracebackException, "__init__", counted)
    tree: BaseException = OSError("leaf")
    for _ in range(8):
        tree = ExceptionGroup("wide", [tree] * 4)
    line = one_line(tree)
    assert len(line) <= 300 and len(described) < 20, (len(described), line)
    assert line.startswith("ExceptionGroup: wide (4 sub-exceptions) [ExceptionGroup: wide")


class _Unsayable:
    def __str__(self) -> str:
        raise RuntimeError("no")


@pytest.mark.parametrize("notes, said", [([_Unsayable(), "model m"], "<note str() failed>: "
                                                                        "model m: "),
                                         ("one note", "one note: "), (5, "5: ")])
def test_notes_set_by_hand_are_said_whatever_they_are(notes, said):
    for exc in (ValueError("bad"), ExceptionGroup("g", [ValueError("bad")])):
        exc.__notes__ = notes
        assert one_line(exc).startswith(said), one_line(exc)
