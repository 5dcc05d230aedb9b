"""An IQ_ variable that nothing reads stops the process, naming the closest known one; the
variables that launchers read instead of Settings are listed in one place
(config.settings.OTHER_VARIABLES), and that list, the code and the docs agree."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import fields
from pathlib import Path

import pytest
import requests
import yaml

from config import ConfigError, Settings, check_metrics_folder, load_settings
from config.settings import ENV_NAMES, KNOWN_VARIABLES, OTHER_VARIABLES, unknown_variables
from scripts.docs_hooks import MEANINGS, DocsError, settings_table
from scripts.processes import free_port, reap_group, signal_group, wait_until
from scripts.stack import ROOT

NAME = re.compile(r"\bIQ_[A-Z0-9][A-Z0-9_]*")


@pytest.mark.parametrize("typo, hint", [
    ("IQ_WORKER_CONCURENCY", "did you mean IQ_WORKER_CONCURRENCY?"),
    ("IQ_JOB_TTL", "did you mean IQ_JOB_TTL_S?"),
    ("IQ_WEBHOOK_SECRETS", "did you mean IQ_WEBHOOK_SECRET?"),
    ("IQ_BANANA", "no setting has a name like it"),
])
def test_an_unknown_variable_is_refused_with_the_closest_name(typo, hint):
    with pytest.raises(ConfigError, match=f"unknown environment variable {typo}: {hint}"):
        load_settings(environ={typo: "1", "IQ_JOB_TTL_S": "60"})


def test_every_unknown_variable_is_named_and_others_are_left_alone():
    environ = {"IQ_RESULT_TTL": "5", "IQ_LOG_LEVL": "DEBUG", "PATH": "/bin",
               "REDIS_PORT": "6380", "FLOWER_PORT": "1", "IQ_JOB_TTL_S": "60"}
    assert unknown_variables(environ) == [
        "unknown environment variable IQ_LOG_LEVL: did you mean IQ_LOG_LEVEL?",
        "unknown environment variable IQ_RESULT_TTL: did you mean IQ_RESULT_TTL_S?"]
    assert load_settings(environ={"PATH": "/bin", "REDIS_PORT": "6380"}) == Settings()


def test_launcher_variables_are_accepted():
    environ = {name: "x" for name in OTHER_VARIABLES if name != "IQ_CONFIG"}
    assert load_settings(environ=environ) == Settings()
    assert not set(OTHER_VARIABLES) & set(ENV_NAMES), "a launcher variable is also a setting"


def tracked(*patterns: str) -> list:
    listed = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    return [ROOT / name for name in listed]


def test_each_launcher_variable_is_read_where_the_list_says():
    for name, where in OTHER_VARIABLES.items():
        for path in re.findall(r"[\w./-]+\.(?:py|sh)", where):
            assert name in (ROOT / path).read_text(), f"{name} is not read in {path}"


def test_every_variable_the_code_and_docs_name_is_known():
    """Launchers, scripts, the client, bench and docs name only variables that a process
    accepts (tests/ outside tests/support may name made-up ones on purpose, and so may an
    example of the refusal)."""
    files = [p for p in tracked() if not p.relative_to(ROOT).parts[0] == "tests"]
    files += tracked("tests/support")
    refusal = re.compile(r"unknown environment variable IQ_\w+")
    named = {(name, p.relative_to(ROOT).as_posix()) for p in files
             for name in NAME.findall(refusal.sub("", p.read_text(errors="replace")))}
    assert {(name, path) for name, path in named if name not in KNOWN_VARIABLES} == set()


def test_the_configuration_page_documents_every_variable():
    """docs/configuration.md's table is generated from Settings (scripts/docs_hooks.py): each
    setting with its default, and a setting without a meaning in docs/settings.yml fails the
    build. The launchers' variables are in its hand-written table."""
    table = settings_table()
    assert set(ENV_NAMES.values()) == {f.name for f in fields(Settings)}
    assert {n for n in ENV_NAMES if f"`{n}`" not in table} == set()
    assert "| `IQ_VISIBILITY_TIMEOUT_S` | `30` |" in table
    assert "| `IQ_MODELS_FILE` | `config/models.yaml` |" in table
    rows = yaml.safe_load(MEANINGS.read_text())
    with pytest.raises(DocsError, match=r"not described \['IQ_MAX_WAIT_S'\]"):
        settings_table([row for row in rows if row["settings"] != ["IQ_MAX_WAIT_S"]])
    with pytest.raises(DocsError, match=r"no such setting \['IQ_BANANA'\]"):
        settings_table(rows + [{"settings": ["IQ_BANANA"], "meaning": "?"}])
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert {n for n in OTHER_VARIABLES if f"`{n}`" not in page} == set()


@pytest.mark.parametrize("script", ["run.sh", "web.sh", "worker.sh", "webhooks.sh",
                                    "flower.sh"])
def test_a_process_with_a_misspelled_variable_refuses_to_start(script):
    """`make run` and each process of the Procfile, started as the Procfile starts them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IQ_")}
    env.update(IQ_WORKER_CONCURENCY="2", IQ_WEBHOOK_SECRET="s3cret", FLOWER_BASIC_AUTH="a:b")
    done = subprocess.run(["bash", f"scripts/{script}"], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=60)
    assert done.returncode != 0
    assert "unknown environment variable IQ_WORKER_CONCURENCY: did you mean " \
           "IQ_WORKER_CONCURRENCY?" in done.stderr


@pytest.mark.parametrize("make", [lambda p: None, lambda p: p.write_text("")],
                         ids=["missing", "a-file"])
def test_a_metrics_folder_the_process_cannot_use_is_refused_naming_the_variable(tmp_path, make):
    """prometheus_client writes each process's counters into PROMETHEUS_MULTIPROC_DIR: named
    wrong, the API's processes failed at their first counter (a traceback of prometheus_client's,
    gunicorn stopping) and a worker served with no /metrics, saying neither why."""
    folder = tmp_path / "metrics"
    make(folder)
    why = "does not exist" if not folder.exists() else "is not a folder"
    with pytest.raises(ConfigError, match=f"^PROMETHEUS_MULTIPROC_DIR '{folder}' {why} "):
        check_metrics_folder({"PROMETHEUS_MULTIPROC_DIR": str(folder)})
    # Set but empty, prometheus_client writes its files in the working folder.
    with pytest.raises(ConfigError, match="^PROMETHEUS_MULTIPROC_DIR '' is empty "):
        check_metrics_folder({"PROMETHEUS_MULTIPROC_DIR": ""})
    folder.unlink(missing_ok=True)
    folder.mkdir()
    check_metrics_folder({"PROMETHEUS_MULTIPROC_DIR": str(folder)})
    check_metrics_folder({})


def _started(script: str, tmp_path, until: str | None = None, **env: str
             ) -> tuple[int | None, str]:
    """`scripts/<script>` started as the Procfile starts it, with `env`, until it exits or
    prints `until` (60 s at most): its exit status (None: it was still running, and was then
    stopped) and what it printed."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("IQ_")}
    environ.update(IQ_VAR_DIR=str(tmp_path / "var"), **env)
    out = tmp_path / f"{script}.out"
    with open(out, "w") as sink:
        proc = subprocess.Popen(["bash", f"scripts/{script}"], cwd=ROOT, env=environ,
                                text=True, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_until(lambda: proc.poll() is not None
                   or (until is not None and until in out.read_text()), 60,
                   f"{script} to exit" + (f" or say {until!r}" if until else ""))
    finally:
        returncode = proc.poll()
        if returncode is None:
            signal_group(proc, signal.SIGTERM)  # make run stops what it started
            reap_group(proc, 60)
    return returncode, out.read_text()


@pytest.mark.parametrize("script, program", [("web.sh", "the API"),
                                             ("worker.sh", "the worker")])
def test_a_process_given_a_missing_metrics_folder_refuses_to_start_in_one_line(
        script, program, tmp_path):
    """Each program that writes metrics files, as the Procfile starts it (the processes it
    starts inherit a folder already checked). Without the check the worker served, with no
    /metrics."""
    returncode, out = _started(script, tmp_path, PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "gone"))
    assert returncode not in (0, None), out
    said = [line for line in out.splitlines() if "PROMETHEUS_MULTIPROC_DIR" in line]
    assert said == [f"{program} will not start: PROMETHEUS_MULTIPROC_DIR "
                    f"'{tmp_path / 'gone'}' does not exist (each process's metrics are written "
                    "there; unset, the API and each worker make a folder of their own)"], out
    assert "Traceback" not in out and not (tmp_path / "gone").exists()


def test_make_run_refuses_one_metrics_folder_for_all_its_programs(tmp_path):
    """A folder sums the counters of every process that writes in it: given to every program
    make run starts, the API's /metrics added in the worker's and Flower's series."""
    (tmp_path / "shared").mkdir()
    returncode, out = _started("run.sh", tmp_path,
                               PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "shared"))
    assert returncode not in (0, None), out
    assert out.strip() == ("make run: PROMETHEUS_MULTIPROC_DIR is one program's folder (the "
                           "API's, or a worker's); make run runs several, and each makes its "
                           "own: unset it"), out
    assert not list((tmp_path / "shared").iterdir())


def test_the_deliverer_keeps_its_metrics_in_memory_whatever_the_variable_says(tmp_path):
    """One process, its metrics in a registry of its own: a PROMETHEUS_MULTIPROC_DIR meant
    for the API's or a worker's processes is not its (set but empty, prometheus_client wrote
    its files into the project's folder; missing, the deliverer failed to start)."""
    before = set(ROOT.glob("*.db"))
    for value in ("", str(tmp_path / "gone")):
        returncode, out = _started("webhooks.sh", tmp_path, "webhook deliverer metrics on",
                                   PROMETHEUS_MULTIPROC_DIR=value, IQ_WEBHOOK_SECRET="s3cret",
                                   IQ_WEBHOOK_METRICS_PORT=str(free_port()))
        assert returncode is None, out
    assert set(ROOT.glob("*.db")) == before


@pytest.mark.parametrize("operators", [False, True], ids=["its-own", "the-operators"])
def test_a_sighup_leaves_the_api_serving_after_its_metrics_folder_is_gone(tmp_path, operators):
    """gunicorn reads its settings file again at each SIGHUP (a models reload sends one):
    checked there, an operator's folder removed since (a cleaner of /tmp) stopped the whole
    API; and the folder the master made at its start, removed, was not made again, so every
    answer of its new processes was a 500."""
    folder = tmp_path / "metrics"
    folder.mkdir()
    port = free_port()
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("IQ_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    environ.update(IQ_PORT=str(port), **({"PROMETHEUS_MULTIPROC_DIR": str(folder)}
                                         if operators else {}))
    log = tmp_path / "web.log"
    with open(log, "w") as out:
        master = subprocess.Popen(["bash", "scripts/web.sh"], cwd=ROOT, env=environ,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        booted = lambda: log.read_text().count("Booting worker")  # noqa: E731
        wait_until(lambda: booted() == 1, 60, "the API's first process")
        if not operators:
            [folder] = Path(tempfile.gettempdir()).glob(f"iq-api-metrics-{master.pid}-*")
        shutil.rmtree(folder)
        master.send_signal(signal.SIGHUP)
        wait_until(lambda: booted() == 2 or master.poll() is not None, 60,
                   "a new process, or the master's exit")
        assert master.poll() is None, log.read_text()
        if not operators:  # made again: the new process counts, and answers
            wait_until(lambda: "Worker exiting" in log.read_text(), 60, "the old one's exit")
            answer = requests.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
            assert answer.status_code != 500, (answer.status_code, log.read_text()[-3000:])
            assert len(list(Path(tempfile.gettempdir()).glob(
                f"iq-api-metrics-{master.pid}-*"))) == 1
    finally:
        signal_group(master, signal.SIGTERM)
        reap_group(master, 60)
