"""The calibrator's answer as a model's max batch on a GPU (scripts/calibrate.py,
config/calibration.py): the search with a fake model and clock (double from 1 until memory runs
out or items/s stops rising, take 80 %), the token budget's cap for a text model, and which
models take the answer (on a GPU, their entry naming no max_batch_size; never on a CPU)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from config import ConfigError, load_settings
from config.calibration import batch_size_for, calibration_path, load_calibration, save_answer
from config.models import parse_model
from scripts.calibrate import calibrate


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeModel:
    """A model whose call of n items takes `cost(n)` seconds of the fake clock and which runs
    out of memory above `oom_above` items."""

    def __init__(self, clock: FakeClock, cost, oom_above: int = 0,
                 max_seq_length: int | None = None) -> None:
        self.clock, self.cost, self.oom_above = clock, cost, oom_above
        self.spec = SimpleNamespace(name="fake")
        self.device = "cpu"
        self.calls: list[int] = []
        self.released = 0
        if max_seq_length is not None:
            self.max_seq_length = max_seq_length

    def sample_inputs(self, n: int) -> list[int]:
        return list(range(n))

    def call(self, items: list) -> None:
        self.calls.append(len(items))
        if self.oom_above and len(items) > self.oom_above:
            raise MemoryError("out of memory")
        self.clock.now += self.cost(len(items))

    def release_memory(self) -> None:
        self.released += 1


def test_it_doubles_until_memory_runs_out_and_takes_80_percent():
    clock = FakeClock()
    model = FakeModel(clock, lambda n: 0.010, oom_above=300)  # a batch costs the same: GPU-like
    result = calibrate(model, repeats=2, clock=clock)
    assert [s.batch_size for s in result.steps] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert result.steps[-1].oom and result.stopped == "out of memory at 512"
    assert model.released == 1
    assert result.largest_safe == 256 and result.max_batch_size == 204  # 80 % of 256
    assert result.steps[-2].items_per_s == pytest.approx(25_600)


def test_it_stops_where_items_per_second_stop_rising():
    clock = FakeClock()
    # 5 ms + 1 ms an item: items/s 167, 286, 444, 615, 762, 865, 928 (+7 %), 962 (+3.7 %).
    model = FakeModel(clock, lambda n: 0.005 + 0.001 * n)
    result = calibrate(model, repeats=1, clock=clock, min_gain=0.05)
    assert result.stopped == "items/s grew less than 5% from 64 to 128"
    assert result.largest_safe == 128 and result.max_batch_size == 102


def test_a_text_models_answer_is_capped_by_the_token_budget():
    clock = FakeClock()
    model = FakeModel(clock, lambda n: 0.010, oom_above=1000, max_seq_length=256)
    result = calibrate(model, repeats=1, clock=clock, max_batch_tokens=16384)
    assert result.largest_safe == 512
    assert result.token_cap == 64 and result.max_batch_size == 64  # 16384 / 256, not 409
    uncapped = calibrate(FakeModel(clock, lambda n: 0.010, oom_above=1000), repeats=1,
                         clock=clock, max_batch_tokens=16384)
    assert uncapped.token_cap is None and uncapped.max_batch_size == 409  # not a text model


def spec(raw: dict):
    return parse_model("enc", {"kind": "synthetic", **raw}, base=None)


def test_on_a_gpu_a_model_without_its_own_max_batch_takes_the_calibrators_answer():
    answers = {"enc": {"device": "cuda:0", "largest_safe": 512, "max_seq_length": 128}}
    assert batch_size_for(spec({}), True, answers, 16384) == 128  # 16384/128 under 409
    assert batch_size_for(spec({}), True, answers, 1 << 20) == 409  # 80 % of 512
    assert batch_size_for(spec({"max_batch_size": 16}), True, answers, 16384) == 16  # declared
    assert batch_size_for(spec({}), False, answers, 16384) == 32  # a CPU: today's default
    assert batch_size_for(spec({}), True, {}, 16384) == 32  # nothing saved
    on_cpu = {"enc": {"device": "cpu", "largest_safe": 512, "max_seq_length": 128}}
    assert batch_size_for(spec({}), True, on_cpu, 16384) == 32  # measured on a CPU
    with pytest.raises(ConfigError, match="calibration_file: model enc: expected largest_safe"):
        batch_size_for(spec({}), True, {"enc": {"device": "cuda", "largest": 5}}, 16384)


@pytest.mark.parametrize("largest", [10**11, 1e300, float("inf"), 65_537, 512.0, True, 0])
def test_an_answer_no_models_file_could_declare_is_refused(largest):
    """The outside attack of session 14: a calibration file's `largest_safe` of 10**11 made a
    batch of 8 * 10**10 (each child's warm-up that many items), the models file's bound gone
    round; Infinity raised OverflowError past the file's refusal. Now each is refused as a
    bad answer (the worker logs it and the model keeps max_batch_size)."""
    answers = {"enc": {"device": "cuda:0", "largest_safe": largest, "max_seq_length": None}}
    with pytest.raises(ConfigError, match="expected largest_safe \\(an integer from 1 to 65536"):
        batch_size_for(spec({}), True, answers, 16384)
    assert batch_size_for(spec({}), True, {"enc": {**answers["enc"], "largest_safe": 65_536}},
                          1 << 30) == 52_428


def test_the_answer_saved_is_read_back_beside_the_models_file(tmp_path):
    settings = load_settings({"models_file": str(tmp_path / "models.yaml")}, environ={})
    path = calibration_path(settings)
    assert path == tmp_path / "calibration.json"
    assert load_calibration(path) == {}
    save_answer(path, "enc", {"device": "cuda:0", "largest_safe": 256, "max_seq_length": None})
    save_answer(path, "other", {"device": "cuda:0", "largest_safe": 8, "max_seq_length": 512})
    assert set(json.loads(path.read_text())) == {"enc", "other"}
    assert batch_size_for(spec({}), True, load_calibration(path), 16384) == 204
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=f"calibration_file {path}: not JSON"):
        load_calibration(path)
    # The re-attack of session 14: each stopped a worker at its start, not refused.
    for content in (b"[" * 100_000, b'{"enc": {"device": "cuda\xff"}}'):
        path.write_bytes(content)
        with pytest.raises(ConfigError, match=f"calibration_file {path}: not JSON"):
            load_calibration(path)


@pytest.mark.parametrize("value", [0, -5])
def test_a_token_budget_below_1_is_refused_naming_it(value):
    with pytest.raises(ConfigError, match=f"max_batch_tokens must be an integer >= 1, "
                                          f"got {value}"):
        load_settings({"max_batch_tokens": value}, environ={})


def test_max_batch_size_declared_is_not_a_key_of_the_models_file():
    with pytest.raises(ConfigError, match="unknown key"):
        spec({"batch_size_declared": True})


@pytest.mark.parametrize("gpus, expected", [(1, 204), (0, 32)])
def test_the_worker_batches_a_model_on_a_gpu_at_the_calibrators_answer(tmp_path, gpus, expected):
    import dataclasses

    from tests.unit.test_dispatcher import dispatcher

    d, _pool, _timer, _unacked = dispatcher()
    path = tmp_path / "calibration.json"
    save_answer(path, "enc", {"device": "cuda:0", "largest_safe": 256, "max_seq_length": None})
    d.settings = dataclasses.replace(d.settings, gpu_count=gpus, calibration_file=str(path))
    assert d.batch_size(spec({})) == expected
    assert d.batch_size(spec({"max_batch_size": 8})) == 8
    path.write_text("[]")  # an operator's mistake: logged, the default kept, no crash
    assert d.batch_size(spec({})) == 32


def calibrated(tmp_path, **extra):
    """Settings whose calibration file answers 256 for model `enc` (80 %: 204)."""
    path = tmp_path / "calibration.json"
    save_answer(path, "enc", {"device": "cuda:0", "largest_safe": 256, "max_seq_length": None})
    return load_settings({"models_file": str(tmp_path / "models.yaml"),
                          "calibration_file": str(path), **extra}, environ={})


@pytest.mark.parametrize("device, expected", [("cuda:0", 204), ("cpu", 32)])
def test_a_child_on_a_gpu_warms_up_at_the_calibrators_answer(tmp_path, monkeypatch, device,
                                                             expected):
    """The child's warm-up batch and its chunks are the batch its worker hands it: on a GPU,
    the calibrator's answer, not the models file's default (a child warmed at 32 and cut a
    204-item batch into chunks of 32)."""
    from workers.child import devices, runtime
    from workers.child.handlers.base import Handler
    from workers.child.handlers.tensor import SyntheticHandler

    warmed: list[int] = []
    monkeypatch.setattr(devices, "device_for", lambda spec, index, runs_torch=True: device)
    monkeypatch.setattr(devices, "prepare_device", lambda *a, **k: None)
    monkeypatch.setattr(SyntheticHandler, "warmup", Handler.warmup)
    monkeypatch.setattr(SyntheticHandler, "predict", lambda self, items, progress=None:
                        warmed.append(len(items)))
    settings = calibrated(tmp_path)
    rt = runtime.ModelRuntime(None, settings, {"enc": spec({})}, ["enc"], "host", 0)
    handler = rt._load("enc")
    assert warmed == [expected]
    assert handler.spec.max_batch_size == expected  # its chunks (Handler.predict)


@pytest.mark.parametrize("gpus, expected", [(1, 2 * 204), (0, 2 * 32)])
def test_the_worker_prefetches_two_calibrated_batches(tmp_path, gpus, expected):
    """The worker's prefetch holds two of its largest batches: on a GPU, the calibrator's."""
    from tasks.celery_app import make_celery

    settings = calibrated(tmp_path)
    app = make_celery(settings, {"enc": spec({})}, gpus=gpus)
    assert app.conf.worker_prefetch_multiplier == expected
