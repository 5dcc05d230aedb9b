"""The registry of model kinds (config/kinds.py): a kind of one's own, registered by a module
the models file lists under `kinds:`, read by config (its keys), the API's schemas (its input)
and the worker (its handler), with no production file touched; and the mistakes an operator
can make with it, each named."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from marshmallow import ValidationError

from app.schemas import job_schema, validate_job
from config.builtin_kinds import BUILTIN
from config.kinds import Kind, kind_names, kind_of, register, unregister
from config.models import parse_models
from config.settings import ConfigError
from scripts.stack import ROOT

ECHO_MODULE = "tests.support.kinds.echo"


def models_file(tmp_path: Path, models: dict, kinds: list | None = None) -> tuple[Path, bytes]:
    data = {"models": models, **({"kinds": kinds} if kinds is not None else {})}
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, path.read_bytes()


def echo_models(tmp_path: Path, **entry) -> dict:
    return parse_models(*models_file(tmp_path, {"hello": {"kind": "echo", **entry}},
                                     [ECHO_MODULE]))


def test_every_shipped_kind_is_registered_with_a_handler_the_worker_resolves():
    from workers.child.handlers import handler_class
    from workers.child.handlers.base import Handler

    assert {k.name for k in BUILTIN} <= set(kind_names())
    for kind in BUILTIN:
        assert issubclass(handler_class(kind.name), Handler), kind.name


def test_a_kind_of_ones_own_is_read_by_config_the_api_and_the_worker(tmp_path):
    spec = echo_models(tmp_path, times=3, sep="-", max_input_chars=20)["hello"]
    assert (spec.kind, spec.input_type, spec.kind_settings) == ("echo", "text",
                                                                {"times": 3, "sep": "-"})
    # The API: a text input of at most max_input_chars, no options, float outputs only.
    schemas = {"hello": job_schema(spec)}
    _, job = validate_job({"model": "hello", "inputs": ["hi"]}, {"hello": spec}, schemas)
    assert job["inputs"] == ["hi"]
    with pytest.raises(ValidationError) as caught:
        validate_job({"model": "hello", "inputs": [7, "x" * 21], "encoding_format": "base64"},
                     {"hello": spec}, schemas)
    assert set(caught.value.messages) == {"inputs", "encoding_format"}
    # The worker: the handler the kind names, run on a batch as a pool child runs it.
    from workers.child.handlers import build_handler

    handler = build_handler(spec, "cpu")
    handler.initialize()
    assert [out["echo"] for out in handler.run([(["ab", "c"], {})])[0]] == ["ab-ab-ab", "c-c-c"]


@pytest.mark.parametrize("entry, message", [
    ({"times": 0}, "models.hello: times must be an integer >= 1, got 0"),
    ({"sep": 5}, "models.hello: sep must be a string, got 5"),
    ({"tmes": 2}, "models.hello: unknown key(s) tmes"),
])
def test_a_kind_of_ones_own_checks_its_keys_naming_field_and_value(tmp_path, entry, message):
    with pytest.raises(ConfigError) as caught:
        echo_models(tmp_path, **entry)
    assert message in str(caught.value)


def test_its_keys_belong_to_it_alone(tmp_path):
    with pytest.raises(ConfigError, match=r"models.m: unknown key\(s\) times"):
        parse_models(*models_file(tmp_path, {"m": {"kind": "synthetic", "times": 2}},
                                  [ECHO_MODULE]))


@pytest.mark.parametrize("kinds, message", [
    (["tests.support.kinds.nowhere"], "kinds: cannot import module "
                                      "'tests.support.kinds.nowhere': ModuleNotFoundError"),
    ("tests.support.kinds.echo", "kinds: must be a list of module names, got "
                                 "'tests.support.kinds.echo'"),
    ([""], "kinds: must be a list of module names"),
])
def test_a_kinds_module_that_cannot_be_imported_is_named(tmp_path, kinds, message):
    with pytest.raises(ConfigError) as caught:
        parse_models(*models_file(tmp_path, {"m": {"kind": "synthetic"}}, kinds))
    assert message in str(caught.value)


def test_a_kind_no_module_registered_names_the_known_ones(tmp_path):
    with pytest.raises(ConfigError) as caught:
        parse_models(*models_file(tmp_path, {"m": {"kind": "token-classification"}}))
    assert "models.m: kind must be one of embedding, classification" in str(caught.value)
    assert "got 'token-classification'" in str(caught.value)


@pytest.fixture
def scratch():
    yield "scratch-kind"
    unregister("scratch-kind")


@pytest.mark.parametrize("changes, message", [
    ({"name": "Bad Name"}, "a kind's name is a lower-case letter"),
    ({"input": "audio"}, "input must be one of text, tensor, image; got 'audio'"),
    ({"handler": "workers.child.handlers.tensor.SyntheticHandler"},
     "handler must be 'package.module:Class'"),
    ({"options": ("temperature",)}, "options must be among labels, top_k; got 'temperature'"),
])
def test_a_kind_declared_wrong_is_refused_naming_what(scratch, changes, message):
    fields = {"name": scratch, "input": "text", "handler": "m:C", **changes}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        register(Kind(**fields))
    assert scratch not in kind_names()


def test_a_name_taken_is_refused_and_the_kind_registered_stays(scratch):
    with pytest.raises(ConfigError, match="kind 'synthetic' is already registered"):
        register(Kind("synthetic", "text", "tests.support.kinds.echo_handler:EchoHandler"))
    assert kind_of("synthetic").handler == "workers.child.handlers.tensor:SyntheticHandler"
    first = register(Kind(scratch, "text", "m:C"))
    assert register(Kind(scratch, "text", "m:C")) == first  # again: nothing changes


def test_a_handler_that_is_no_handler_is_refused_in_the_child(scratch):
    from workers.child.handlers import handler_class

    register(Kind(scratch, "text", "config.kinds:Kind"))
    with pytest.raises(ValueError, match="handler config.kinds:Kind is not a subclass"):
        handler_class(scratch)


def test_reading_a_kind_of_ones_own_imports_no_model_code(tmp_path):
    """The API and a worker's main process read every kind: the echo kind's handler (and the
    worker's handlers, torch) stay unimported there."""
    path, _ = models_file(tmp_path, {"hello": {"kind": "echo"}}, [ECHO_MODULE])
    code = ("import sys; from config.models import load_models; "
            f"load_models({str(path)!r}); "
            "print(sorted(m for m in sys.modules if m.startswith(('workers', 'torch')) "
            "or m.endswith('echo_handler')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_its_own_keys_count_in_the_version_and_the_shipped_kinds_versions_stay(tmp_path):
    from config.models import settings_digest

    twice, thrice = (settings_digest(echo_models(tmp_path, times=n)["hello"]) for n in (2, 3))
    assert twice != thrice
    # A shipped kind has no keys of its own: its digest is what it was before kind_settings.
    spec = parse_models(*models_file(tmp_path, {"s": {"kind": "synthetic", "base_ms": 3}}))["s"]
    import hashlib
    import json
    from dataclasses import asdict

    before = {k: v for k, v in asdict(spec).items() if k not in (
        "name", "path", "package", "runs_log", "version", "redis", "load_gate", "kind_settings")}
    assert settings_digest(spec) == hashlib.sha256(
        json.dumps(before, sort_keys=True, default=str).encode()).hexdigest()


def test_a_part_that_only_routes_reads_the_file_without_importing_its_kinds(tmp_path):
    """The deliverer and Flower (make_celery(kinds=False)) take each model's name, queue and
    Redis group from the file without importing its `kinds:` modules, which are code; a
    `kinds:` that is no list of names is still refused there, naming it."""
    path, _ = models_file(tmp_path, {"hello": {"kind": "echo", "queue": "q", "times": 2,
                                               "max_batch_size": 3}}, [ECHO_MODULE])
    code = ("import sys; from config.models import read_models; "
            f"spec = read_models({str(path)!r}, kinds=False)[0]['hello']; "
            f"print({ECHO_MODULE!r} in sys.modules, spec.kind, spec.queue, "
            "spec.max_batch_size)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["False", "echo", "q", "3"], out
    bad, content = models_file(tmp_path, {"hello": {"kind": "echo"}}, "nope")
    with pytest.raises(ConfigError, match=r"kinds: must be a list of module names, got 'nope'"):
        parse_models(bad, content, kinds=False)
