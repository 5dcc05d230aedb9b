"""How many API processes gunicorn starts (gunicorn.conf.py): a quarter of the usable cores,
at least one, unless IQ_WEB_WORKERS says; each start gets a metrics folder of its own."""
from __future__ import annotations

import os
import runpy

import pytest

from scripts.processes import ROOT
from web import handover
from web.worker import settle


def _conf(monkeypatch, tmp_path, cores: int, **env: str) -> dict:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("IQ_WEB_WORKERS", raising=False)
    for name in ("PROMETHEUS_MULTIPROC_DIR", "_IQ_API_HANDOVER_DIR"):
        monkeypatch.setenv(name, "")  # recorded, so that what the file sets is undone
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR read afresh
    return runpy.run_path(str(ROOT / "gunicorn.conf.py"))


@pytest.mark.parametrize("cores,workers", [(1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (64, 16)])
def test_default_is_a_quarter_of_the_usable_cores(monkeypatch, tmp_path, cores, workers):
    assert _conf(monkeypatch, tmp_path, cores)["workers"] == workers


def test_iq_web_workers_wins(monkeypatch, tmp_path):
    assert _conf(monkeypatch, tmp_path, 16, IQ_WEB_WORKERS="1")["workers"] == 1
    assert _conf(monkeypatch, tmp_path, 2, IQ_WEB_WORKERS="3")["workers"] == 3


def test_several_processes_get_a_fresh_metrics_folder_removed_at_exit(monkeypatch, tmp_path):
    conf = _conf(monkeypatch, tmp_path, 16)
    folder = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    assert os.path.dirname(folder) == str(tmp_path) and os.path.isdir(folder)
    conf["on_exit"](None)
    assert not os.path.exists(folder)


def test_one_process_gets_a_folder_too_and_an_operators_folder_is_kept(monkeypatch, tmp_path):
    """`-w`, GUNICORN_CMD_ARGS or a SIGTTIN may run more processes than the one planned here:
    their counts are summed all the same."""
    conf = _conf(monkeypatch, tmp_path, 2)
    assert conf["workers"] == 1
    folder = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    assert os.path.dirname(folder) == str(tmp_path) and os.path.isdir(folder)
    conf["on_exit"](None)
    assert not os.path.exists(folder)
    mine = tmp_path / "mine"
    mine.mkdir()
    conf = _conf(monkeypatch, tmp_path, 16, PROMETHEUS_MULTIPROC_DIR=str(mine))
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(mine)
    conf["on_exit"](None)
    assert mine.is_dir()


def test_a_master_keeps_its_folder_on_a_reload_and_makes_its_own_after_a_binary_upgrade(
        monkeypatch, tmp_path):
    """SIGHUP reads this file again in the same master: its folder stays. A USR2 after a
    SIGHUP execs a new master with the old one's variable (gunicorn copies the environment
    when it re-reads its settings): the new one makes its own, and the old one's exit, which
    removes the old folder, leaves it."""
    conf = _conf(monkeypatch, tmp_path, 16)
    folder = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    assert runpy.run_path(str(ROOT / "gunicorn.conf.py")) and \
        os.environ["PROMETHEUS_MULTIPROC_DIR"] == folder
    old_master = tmp_path / "iq-api-metrics-1-abc"  # made by master pid 1, inherited
    old_master.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(old_master))
    conf = runpy.run_path(str(ROOT / "gunicorn.conf.py"))
    mine = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    assert mine not in (str(old_master), folder) and os.path.isdir(mine)
    conf["on_exit"](None)
    assert not os.path.exists(mine) and old_master.is_dir()


def test_a_process_told_to_stop_by_a_reload_waits_for_its_replacements(monkeypatch, tmp_path):
    """The hand-over across a SIGHUP (tests/integration/test_api_sighup.py with gunicorn):
    processes 1 and 2 serve; a reload starts 3 and 4. Told to stop, 1 and 2 go on accepting
    until both new ones are up; a stop with no reload since they started is not delayed."""
    from types import SimpleNamespace

    conf = _conf(monkeypatch, tmp_path, 16)
    replaced = handover.replaced
    for age in (1, 2):
        conf["post_worker_init"](SimpleNamespace(age=age, pid=100 + age))
    assert replaced(1, 2) and replaced(2, 2), "no reload: a stop"
    conf["on_reload"](SimpleNamespace(worker_age=2))
    assert not replaced(1, 2)
    conf["post_worker_init"](SimpleNamespace(age=3, pid=103))
    assert not replaced(2, 2), "one of the two up"
    conf["child_exit"](None, SimpleNamespace(age=1, pid=101))  # an old one gone: not counted
    conf["post_worker_init"](SimpleNamespace(age=4, pid=104))
    assert replaced(1, 2) and replaced(2, 2)
    assert replaced(3, 2) and replaced(4, 2), "the new ones stop at once when told"
    conf["on_exit"](None)
    assert not os.path.exists(os.environ["_IQ_API_HANDOVER_DIR"])


def test_a_stop_of_the_master_ends_the_wait_for_replacements(monkeypatch, tmp_path):
    """The master's stop (its handler, installed by `when_ready`) is noted before gunicorn's own
    handler queues it: a process waiting for replacements stops waiting, as that signal says
    (tests/integration/test_api_sighup.py with gunicorn)."""
    import signal
    from types import SimpleNamespace

    conf = _conf(monkeypatch, tmp_path, 16)
    conf["on_reload"](SimpleNamespace(worker_age=2))
    assert not handover.replaced(1, 2) and handover.stopping() is None
    queued = []
    handover.stop_noted(os.getpid(), lambda sig, frame: queued.append(sig), signal.SIGINT, None)
    assert queued == [signal.SIGINT], "gunicorn's own handler still called"
    assert handover.stopping() == signal.SIGINT and handover.replaced(1, 2)
    conf["on_exit"](None)  # its folder gone: a later signal is still handed on
    handover.stop_noted(os.getpid(), lambda sig, frame: queued.append(sig), signal.SIGTERM, None)
    assert queued == [signal.SIGINT, signal.SIGTERM]


def test_a_process_reads_each_setting_once_not_through_config_at_each_use(monkeypatch,
                                                                         tmp_path):
    """gunicorn reads ~23 settings a request through `Config.__getattr__`; settled, none."""
    from gunicorn.config import Config

    cfg = Config()
    cfg.set("keepalive", 7)
    cfg.set("certfile", "/x.pem")
    asked: list[str] = []
    real = Config.__getattr__

    def counting(self, name):
        asked.append(name)
        return real(self, name)

    monkeypatch.setattr(Config, "__getattr__", counting)
    expected = {name: setting.get() for name, setting in cfg.settings.items()}
    asked.clear()
    settle(cfg)
    names = ("keepalive", "limit_request_line", "limit_request_fields", "forwarded_allow_ips",
             "pre_request", "post_request", "header_map", "workers", "secure_scheme_headers")
    assert {name: getattr(cfg, name) for name in names} == \
        {name: expected[name] for name in names} and cfg.keepalive == 7
    assert cfg.is_ssl and asked == []  # a property of Config's, reading settled values
    with pytest.raises(AttributeError):
        cfg.keepalive = 3  # still guarded


def test_a_reload_reads_web_anew_as_it_reads_this_file(monkeypatch, tmp_path):
    """A SIGHUP reads gunicorn.conf.py again in the same master, whose new processes run the
    code on disk: web/'s worker class too, as when it was defined in gunicorn.conf.py, not the
    one the master imported at its start."""
    conf = _conf(monkeypatch, tmp_path, 2)
    again = runpy.run_path(str(ROOT / "gunicorn.conf.py"))
    assert again["worker_class"] is not conf["worker_class"]
    assert again["worker_class"].__module__ == "web.worker"
    again["on_exit"](None)
