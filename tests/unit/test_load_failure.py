"""Why a pool child could not load its models, kept for its worker's exit status
(workers/child/load_failure.py) in the worker's own folder (workers/spawn.py)."""
from __future__ import annotations

import logging

from workers.child import load_failure
from workers.spawn import FOLDER_VARIABLE


def test_the_first_childs_reason_is_kept_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(FOLDER_VARIABLE, str(tmp_path))
    load_failure.record("pool child 0 could not load its models:\n  model m on cpu: " + "x" * 500)
    load_failure.record("pool child 1 could not load its models: later")
    kept = load_failure.reason()
    assert kept.startswith("pool child 0 could not load its models: model m on cpu: xxx")
    assert len(kept) == 400 and kept.endswith("…")  # cut, and said to be


def test_a_reason_that_cannot_be_kept_is_logged(tmp_path, monkeypatch, caplog):
    """The outside attack of session 14: with the worker's folder removed (a cleaner of /tmp),
    the reason was dropped without a word and the worker exited 0."""
    monkeypatch.setenv(FOLDER_VARIABLE, str(tmp_path / "gone"))
    with caplog.at_level(logging.ERROR, logger="workers.child.load_failure"):
        load_failure.record("pool child 0 could not load its models: model m on cpu: boom")
    assert load_failure.reason() == ""
    [logged] = caplog.records
    assert "was not kept" in logged.getMessage() and "model m on cpu: boom" in logged.getMessage()
