"""A worker's prefetch (workers/batching/prefetch.py, tasks/celery_app.py
`prefetch_multiplier`): two full batches per child of the largest model it serves, not of the
largest in its models file; IQ_PREFETCH_MULTIPLIER wins; the dispatcher sizes it again, live,
when its models or queues change. The worker itself, with -Q and a reload:
tests/integration/test_prefetch.py."""
from __future__ import annotations

from types import SimpleNamespace

from kombu.common import QoS

from config import load_settings
from config.calibration import save_answer
from config.models import parse_model
from tasks.celery_app import prefetch_multiplier
from workers.batching import prefetch
from workers.batching.dispatcher import PoolDispatcher
from workers.broker import Broker


def settings(**given):
    return load_settings({"redis_url": "redis://127.0.0.1:1/0", **given}, environ={})


def spec(name: str, **raw):
    return parse_model(name, {"kind": "synthetic", **raw}, base=None)


def test_two_full_batches_of_the_largest_served_model_unless_the_setting_says():
    assert prefetch_multiplier(settings(), [4]) == 8
    assert prefetch_multiplier(settings(), [4, 32, 16]) == 64
    assert prefetch_multiplier(settings(), []) == 2  # it serves nothing: fetches little
    assert prefetch_multiplier(settings(prefetch_multiplier=3), [4, 32]) == 3


def test_the_models_served_are_those_of_the_queues_consumed():
    models = {"tiny": spec("tiny", max_batch_size=4),
              "wide": spec("wide", max_batch_size=32, queue="wide-q")}
    assert [s.name for s in prefetch.served(models, ["tiny"])] == ["tiny"]
    assert [s.name for s in prefetch.served(models, ["tiny", "wide-q"])] == ["tiny", "wide"]
    assert prefetch.served(models, ["wide"]) == []  # the model's name is not its queue


class Consumer(SimpleNamespace):
    """Celery's worker consumer as the prefetch reads it: two pool children at Celery's
    multiplier of 64, connected (its Tasks bootstep's QoS, whose callback is the channel's)."""

    def __init__(self, models: dict, queues: list[str], **conf) -> None:
        self.channel: list[int] = []
        super().__init__(
            prefetch_multiplier=64, initial_prefetch_count=128,
            qos=QoS(lambda prefetch_count: self.channel.append(prefetch_count), 128),
            task_consumer=SimpleNamespace(queues=[SimpleNamespace(name=q) for q in queues]),
            app=SimpleNamespace(conf=SimpleNamespace(
                iq_settings=settings(**conf), iq_models=models, iq_models_revision="",
                iq_broker=Broker())),
            pool=SimpleNamespace(num_processes=2), timer=None, connection=object(),
            hostname="w@test")


def test_fit_sets_what_celery_builds_the_qos_from_and_the_live_qos():
    c = Consumer({}, [])
    c.qos.update()
    assert c.channel == [128]
    assert prefetch.fit(c, 8)
    # A reconnect's Tasks bootstep sets the channel's QoS to initial_prefetch_count; a
    # pool_grow moves it by the multiplier.
    assert (c.prefetch_multiplier, c.initial_prefetch_count, c.qos.value) == (8, 16, 16)
    c.qos.update()  # the event loop's next turn
    assert c.channel == [128, 16]
    assert not prefetch.fit(c, 8)
    assert prefetch.fit(c, 40) and c.initial_prefetch_count == 80  # raised again
    disconnected = Consumer({}, [])
    disconnected.qos = None
    assert prefetch.fit(disconnected, 8) and disconnected.initial_prefetch_count == 16


def dispatcher(models: dict, queues: list[str], **conf) -> tuple[PoolDispatcher, Consumer]:
    consumer = Consumer(models, queues, **conf)
    return PoolDispatcher(consumer), consumer


def test_the_dispatcher_sizes_it_by_the_queues_it_consumes_and_follows_a_reload():
    tiny, wide = spec("tiny", max_batch_size=4), spec("wide", max_batch_size=32)
    d, c = dispatcher({"tiny": tiny, "wide": wide}, ["tiny"])
    d.fit_prefetch()
    assert (c.prefetch_multiplier, c.initial_prefetch_count) == (8, 16)
    # `control add_consumer wide`: seen at the next tick.
    c.task_consumer.queues.append(SimpleNamespace(name="wide"))
    d.fit_prefetch()
    assert (c.prefetch_multiplier, c.qos.value) == (64, 128)
    # A reload that makes wide smaller (a new models file: a new mapping).
    c.app.conf.iq_models = {"tiny": tiny, "wide": spec("wide", max_batch_size=2)}
    d.fit_prefetch()
    assert c.prefetch_multiplier == 8
    # A reload that removes tiny: its queue stays consumed (its jobs fail as they arrive),
    # it counts no more.
    c.app.conf.iq_models = {"wide": spec("wide", max_batch_size=2)}
    d.fit_prefetch()
    assert c.prefetch_multiplier == 4


def test_the_setting_wins_over_any_model():
    d, c = dispatcher({"wide": spec("wide", max_batch_size=32)}, ["wide"],
                      prefetch_multiplier=3)
    d.fit_prefetch()
    assert (c.prefetch_multiplier, c.initial_prefetch_count) == (3, 6)


def test_on_a_gpu_the_calibrators_batch_sizes_it(tmp_path):
    """A model whose entry names no max_batch_size, on a GPU: the calibrator's answer (80 %
    of 256), as the dispatcher batches it."""
    path = tmp_path / "calibration.json"
    save_answer(path, "enc", {"device": "cuda:0", "largest_safe": 256, "max_seq_length": None})
    d, c = dispatcher({"enc": spec("enc")}, ["enc"], calibration_file=str(path),
                      gpu_count=1)
    d.fit_prefetch()
    assert c.prefetch_multiplier == 2 * 204


def test_it_holds_no_more_than_a_qos_can_limit():
    """Past kombu's 65535 the QoS is switched off ("QoS: Disabled") and the worker takes every
    job waiting: two children of a model of batch 40000 (80000 a child) hold 32767 each. A
    multiplier Celery set that high at start is lowered though the models did not change it."""
    c = Consumer({}, [])
    assert prefetch.fit(c, 80_000)
    assert (c.prefetch_multiplier, c.initial_prefetch_count, c.qos.value) == (32_767, 65_534,
                                                                              65_534)
    started = Consumer({}, [])
    started.prefetch_multiplier, started.initial_prefetch_count = 40_000, 80_000
    assert prefetch.fit(started, 40_000) and started.initial_prefetch_count == 65_534
