from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from config import ConfigError, load_models, load_settings
from config.settings import CONFIG_DIR


def test_layering_defaults_then_yaml_then_environment(tmp_path):
    config_file = tmp_path / "service.yaml"
    config_file.write_text(yaml.safe_dump({"max_body_bytes": 2048, "job_ttl_s": 60}))
    env = {"IQ_CONFIG": str(config_file), "IQ_JOB_TTL_S": "120", "REDIS_URL": "redis://h:1/2"}
    s = load_settings(environ=env)
    assert s.max_body_bytes == 2048          # from YAML
    assert s.job_ttl_s == 120                # environment beats YAML
    assert s.redis_url == "redis://h:1/2"
    assert s.max_wait_s == 30.0              # default
    assert load_settings({"job_ttl_s": 5}, environ=env).job_ttl_s == 5


def test_unknown_setting_and_bad_types_are_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_setting: 1\n")
    with pytest.raises(ConfigError, match="no_such_setting"):
        load_settings(environ={"IQ_CONFIG": str(bad)})
    with pytest.raises(ConfigError, match="IQ_JOB_TTL_S must be int"):
        load_settings(environ={"IQ_JOB_TTL_S": "soon"})


def test_shipped_models_file_parses():
    models = load_models(CONFIG_DIR / "models.yaml")
    assert set(models) == {"minilm-embed", "minilm-classify"}
    assert models["minilm-classify"].labels
    assert models["minilm-embed"].queue == "minilm-embed"


def write(tmp_path: Path, models: dict) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump({"models": models}))
    return path


@pytest.mark.parametrize("model, message", [
    ({"kind": "nope"}, "kind must be one of"),
    ({"kind": "synthetic", "max_batch_size": 0}, "max_batch_size must be an integer >= 1, got 0"),
    ({"kind": "synthetic", "max_wait_ms": -1}, "max_wait_ms must be a finite number >= 0"),
    ({"kind": "synthetic", "base_ms": float("nan")},
     "base_ms must be a finite number >= 0, got nan"),
    ({"kind": "synthetic", "timeout_s": float("inf")},
     "timeout_s must be a finite number >= 0, got inf"),
    ({"kind": "synthetic", "memory_fraction": float("nan")}, "memory_fraction must be a finite"),
    ({"kind": "embedding"}, "needs `package`"),
    ({"kind": "torchscript", "input_shape": [4]}, "needs `path`"),
    ({"kind": "torchscript", "path": "m.pt"}, "input_shape must be"),
    ({"kind": "synthetic", "surprise": 1}, "unknown key"),
    ({"kind": "synthetic", "device": "tpu"}, "device must be one of"),
    ({"kind": "embedding", "package": "p", "path": "f"}, "not both"),
    ({"kind": "sequence-classification", "package": "p"}, "needs `path`"),
    ({"kind": "export", "path": "m.pt2", "input_shape": [4], "dtype": "int8"},
     "dtype int8 applies to the kinds embedding"),
    ({"kind": "embedding", "package": "p", "dtype": "int8", "device": "cuda"},
     "int8 runs on the CPU only"),
    ({"kind": "synthetic", "memory_fraction": 1.5}, "memory_fraction must be in"),
    ({"kind": "synthetic", "prepare_ms": -0.5},
     "prepare_ms must be a finite number >= 0, got -0.5"),
    ({"kind": "synthetic", "output_floats": 0}, "output_floats must be an integer >= 1, got 0"),
    # The outside attack of session 13: each new child built 10**11 warm-up inputs.
    ({"kind": "synthetic", "max_batch_size": 10**11},
     "max_batch_size must be an integer from 1 to 65536, got 100000000000"),
    ({"kind": "synthetic", "output_floats": 65_537},
     "output_floats must be an integer from 1 to 65536, got 65537"),
    ({"kind": "embedding", "package": "p", "prepare_ms": 1}, "unknown key\\(s\\) prepare_ms"),
    ({"kind": "image", "path": "m.pt2"}, "needs `preprocess`"),
    ({"kind": "image", "path": "m.pt2", "preprocess": {"resize": 256}}, "add `crop`"),
    ({"kind": "image", "path": "m.pt2", "preprocess": {"resize": 64, "crop": 96}},
     "crop \\[96, 96\\] is larger"),
    ({"kind": "image", "path": "m.pt2", "preprocess": {"resize": [8, 8], "std": [1, 0, 1]}},
     "std must be three numbers > 0"),
])
def test_model_declaration_errors_name_the_field(tmp_path, model, message):
    with pytest.raises(ConfigError, match=message):
        load_models(write(tmp_path, {"m": model}))


def test_relative_torchscript_path_is_taken_from_the_models_file(tmp_path):
    models = load_models(write(tmp_path, {"ts": {"kind": "torchscript", "path": "m.pt",
                                                 "input_shape": [2, 3]}}))
    assert models["ts"].path == str(tmp_path / "m.pt")
    assert models["ts"].input_shape == (2, 3)


def test_two_models_cannot_share_a_queue(tmp_path):
    with pytest.raises(ConfigError, match="already used"):
        load_models(write(tmp_path, {"a": {"kind": "synthetic", "queue": "q"},
                                     "b": {"kind": "synthetic", "queue": "q"}}))


def keys_file(tmp_path: Path, keys: list[dict]) -> str:
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": keys}))
    return str(path)


def test_api_keys_load_with_their_limits(tmp_path):
    from app.auth import hash_key, load_keys

    keys = load_keys(keys_file(tmp_path, [
        {"name": "a", "sha256": hash_key("key-a")},
        {"name": "b", "sha256": hash_key("key-b"), "rate_per_s": 2.5, "models": ["m"]},
    ]))
    assert keys[hash_key("key-a")].rate_per_s == 0
    b = keys[hash_key("key-b")]
    assert (b.name, b.rate_per_s, b.burst, b.models) == ("b", 2.5, 3, frozenset({"m"}))


@pytest.mark.parametrize("second, message", [
    ({"name": "ops", "sha256": "b" * 64},
     r"keys\[1\]\.name 'ops' is already the name of keys\[0\]"),
    ({"name": "other", "sha256": "a" * 64}, r"keys\[1\]\.sha256 is already the hash of key 'ops'"),
    ({"name": "other", "sha256": "b" * 64, "rate_per_s": 5, "burst": 0},
     r"keys\[1\]\.burst must be an integer >= 1 with a rate_per_s, got 0"),
    ({"name": "other", "sha256": "b" * 64, "rate_per_s": -1}, r"rate_per_s must be >= 0, got -1"),
    ({"name": "other", "sha256": "b" * 64, "rate_per_s": "fast"}, r"got 'fast'"),
])
def test_api_key_mistakes_are_named(tmp_path, second, message):
    from app.auth import load_keys

    with pytest.raises(ConfigError, match=message):
        load_keys(keys_file(tmp_path, [{"name": "ops", "sha256": "a" * 64}, second]))


@pytest.mark.parametrize("overrides, message", [
    ({"image_decoders": 0}, "image_decoders must be an integer >= 1, got 0"),
    ({"image_decode_timeout_s": 0}, "image_decode_timeout_s must be > 0, got 0"),
    ({"image_decode_budget_s": -1}, "image_decode_budget_s must be > 0, got -1"),
    ({"image_decoders_per_key": 3}, r"image_decoders_per_key must be 0 \(half the decoders\) "
                                    r"to image_decoders \(2\), got 3"),
    ({"image_decode_memory_mb": 100}, "image_decode_memory_mb must be an integer >= 256, got 100"),
    ({"body_timeout_s": -1}, "body_timeout_s must be > 0, got -1"),
    ({"forwarded_allow_ips": "10.0.0.0/8, proxy.local"},
     "forwarded_allow_ips must list IP addresses or CIDRs, got 'proxy.local'"),
    ({"kept_bytes_per_key": 1000}, r"kept_bytes_per_key must be 0 \(no quota\) or at least "
                                   r"max_body_bytes \(1048576\).*got 1000"),
    ({"kept_bytes_per_key": 2_000_000, "kept_inputs_max_bytes": 3_000_000},
     r"kept_bytes_per_key must be 0 \(no quota\) or at least kept_inputs_max_bytes "
     r"\(3000000\).*got 2000000"),
    ({"max_uploads_per_key": -1}, "max_uploads_per_key must be an integer >= 0, got -1"),
    ({"read_rate_per_key": float("nan")}, "read_rate_per_key must be >= 0, got nan"),
    ({"read_burst_per_key": 0}, "read_burst_per_key must be an integer >= 1 with a "
                                "read_rate_per_key, got 0"),
])
def test_security_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_settings(overrides, environ={})


def test_the_settings_repr_shows_no_secret():
    shown = repr(load_settings({"redis_url": "redis://iq:s3cret@redis:6379/0",
                                "webhook_secret": "hook-s3cret",
                                "redis_sentinel_password": "sentinel-s3cret"}, environ={}))
    assert "s3cret" not in shown and "redis://iq:**@redis:6379/0" in shown
    assert "webhook_secret='**'" in shown and "redis_sentinel_password='**'" in shown


@pytest.mark.parametrize("overrides, message", [
    ({"redis_deadline_s": 0}, "redis_deadline_s must be > 0, got 0"),
    ({"redis_sentinels": "h1:26379,h2"},
     "redis_sentinels must list host:port entries, comma-separated, got 'h2'"),
    ({"redis_sentinels": "h1:99999"}, "redis_sentinels must list host:port .*got 'h1:99999'"),
    ({"redis_sentinels": "h1:26379", "redis_master": ""}, "redis_master must name the primary"),
    ({"redis_wait_replicas": -2}, "redis_wait_replicas must be an integer >= -1"),
    ({"redis_wait_replicas": 1, "redis_wait_timeout_s": 2},
     r"redis_wait_timeout_s must be > 0 and below redis_deadline_s \(2\), got 2"),
])
def test_redis_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_settings(overrides, environ={})


def test_sentinels_are_read_and_turn_the_replica_wait_on():
    plain = load_settings(environ={})
    assert plain.sentinel_hosts == [] and plain.wait_replicas == 0
    sentinel = load_settings(environ={"IQ_REDIS_SENTINELS": "10.0.0.1:26379, [::1]:26380"})
    assert sentinel.sentinel_hosts == [("10.0.0.1", 26379), ("::1", 26380)]
    assert sentinel.wait_replicas == 1  # on by default with Sentinel
    assert load_settings({"redis_wait_replicas": 0}, environ={
        "IQ_REDIS_SENTINELS": "h:1"}).wait_replicas == 0
    assert load_settings({"redis_wait_replicas": 2}, environ={}).wait_replicas == 2


@pytest.mark.parametrize("where", ["missing", "folder", "unreadable"])
def test_a_settings_file_that_cannot_be_read_is_one_line_naming_it(tmp_path, where):
    path = tmp_path / "service.yaml"
    if where == "folder":
        path.mkdir()
    elif where == "unreadable":
        path.write_text("job_ttl_s: 60\n")
        path.chmod(0)
        if os.access(path, os.R_OK):
            pytest.skip("root reads every file")
    with pytest.raises(ConfigError) as raised:
        load_settings(environ={"IQ_CONFIG": str(path)})
    message = str(raised.value)
    assert message.startswith(f"IQ_CONFIG {path}: cannot be read (") and "\n" not in message


@pytest.mark.parametrize("settings, named", [
    ({"webhook_secret": "s3cret"}, "webhook_secret"),
    ({"redis_url": "redis://app:pw@h:1/0"}, "redis_url (its password)"),
    ({"redis_groups": {"gpu": "redis://:pw@g:1/0"}}, "redis_groups.gpu (its password)"),
])
def test_a_settings_file_with_a_secret_others_may_read_is_refused(tmp_path, settings, named):
    path = tmp_path / "service.yaml"
    path.write_text(yaml.safe_dump(settings))
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=rf"IQ_CONFIG {path} holds {re.escape(named)} and "
                                          r"other users may read it \(mode 0644\)"):
        load_settings(environ={"IQ_CONFIG": str(path)})
    path.chmod(0o600)
    load_settings(environ={"IQ_CONFIG": str(path)})
    path.write_text(yaml.safe_dump({"redis_url": "redis://h:1/0"}))  # no secret in it
    path.chmod(0o644)
    load_settings(environ={"IQ_CONFIG": str(path)})


@pytest.mark.parametrize("value", [-1, 0x10000])
def test_the_prefetch_multiplier_is_one_celery_can_hold(value):
    """-1 had a worker fetch nothing (its jobs queued forever); past 65535 kombu switches the
    QoS off and a worker takes every job waiting."""
    with pytest.raises(ConfigError, match=r"prefetch_multiplier must be an integer from 0 "
                                          rf"\(two full batches .*\) to 65535, got {value}"):
        load_settings({"prefetch_multiplier": value}, environ={})
    assert load_settings({"prefetch_multiplier": 0xFFFF}, environ={}).prefetch_multiplier


def test_the_prefetch_bound_is_kombus_and_config_imports_no_library():
    """config/ keeps its own copy of kombu's PREFETCH_COUNT_MAX: it is loaded by gunicorn's
    master before gevent patches the standard library, where kombu must not be imported."""
    import subprocess
    import sys

    from kombu.common import PREFETCH_COUNT_MAX

    from config import checks
    assert checks.PREFETCH_COUNT_MAX == PREFETCH_COUNT_MAX
    loaded = subprocess.run([sys.executable, "-c", "import sys, config; print(sorted(m for m in "
                             "('kombu', 'celery', 'redis') if m in sys.modules))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
