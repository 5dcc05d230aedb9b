"""Find a model's batch size by measuring it: `python -m scripts.calibrate MODEL`.

Loads the model as a pool child would (its device, memory fraction, weights, warm-up), then
calls it on 1, 2, 4, … items, recording the time per batch, items/s and, on a GPU, peak memory.
It stops at the first out-of-memory, or once doubling the batch no longer raises items/s by
`--min-gain` (5%). It recommends `max_batch_size` = 80% of the largest size that ran (headroom
for longer inputs than the samples), and `max_wait_ms` = the time of a call of one item:
holding a job longer than that to fill a batch costs more than running it would have. For a
text model the recommendation is capped by the token budget: `max_batch_tokens` / its max
sequence length (text-embeddings-inference's max-batch-tokens).

With `--save`, the answer goes to the calibration file (`calibration_file`), where a worker takes
it as the model's max batch on a GPU unless the models file declares one (config/calibration.py).

Each batch size is timed `--repeats` times and the fastest call counts; when the slowest of a
size's calls took more than `NOISY` longer than its fastest, other work disturbed the timings
(a busy machine) and the recommendation is said to be untrustworthy. The plot goes to
bench/results/calibration-MODEL.png unless `--plot` says where.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from config import load_models, load_settings
from config.calibration import calibration_path, recommended, save_answer, token_cap
from workers.child.handlers.base import Handler, is_oom

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
NOISY = 0.25  # a size's slowest call this much over its fastest: the timings were disturbed


@dataclass
class Step:
    batch_size: int
    ms_per_batch: float = 0.0
    items_per_s: float = 0.0
    peak_memory_mb: float | None = None  # GPU only
    oom: bool = False
    spread: float = 0.0  # the slowest call over the fastest, less one


@dataclass
class Calibration:
    model: str
    device: str
    steps: list[Step] = field(default_factory=list)
    stopped: str = ""
    repeats: int = 3  # timed calls per batch size
    max_seq_length: int | None = None  # a text model's
    token_cap: int | None = None  # max_batch_tokens / max_seq_length

    @property
    def largest_safe(self) -> int:
        return max((s.batch_size for s in self.steps if not s.oom), default=0)

    @property
    def max_batch_size(self) -> int:
        return recommended(self.largest_safe, self.token_cap)

    @property
    def noisy(self) -> list[Step]:
        """The sizes whose calls varied more than NOISY: their timings are not to be trusted."""
        return [s for s in self.steps if not s.oom and s.spread > NOISY]

    @property
    def max_wait_ms(self) -> float:
        return max(0.5, round(self.steps[0].ms_per_batch, 1)) if self.steps else 5.0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def measure(handler: Handler, size: int, repeats: int,
            clock: Callable[[], float] = time.perf_counter) -> Step:
    """The fastest of `repeats` calls of `size` items, after one call to warm that size: on a
    machine shared with other work the fastest call is the one least disturbed by it."""
    import torch

    items = handler.sample_inputs(size)
    handler.call(items)
    cuda = handler.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats(handler.device)
    times = []
    for _ in range(repeats):
        _sync(handler.device)
        started = clock()
        handler.call(items)
        _sync(handler.device)
        times.append(clock() - started)
    seconds = min(times)
    peak = torch.cuda.max_memory_allocated(handler.device) / 2**20 if cuda else None
    return Step(size, 1000 * seconds, size / seconds, peak, spread=max(times) / seconds - 1)


def calibrate(handler: Handler, limit: int = 4096, min_gain: float = 0.05,
              repeats: int = 3, clock: Callable[[], float] = time.perf_counter,
              max_batch_tokens: int | None = None) -> Calibration:
    """Double the batch from 1 until memory runs out or items/s stops rising; with
    `max_batch_tokens`, a text model's answer is capped at it over its max sequence length."""
    seq = getattr(handler, "max_seq_length", None)
    seq = seq if isinstance(seq, int) and seq > 0 else None
    result = Calibration(handler.spec.name, handler.device, repeats=repeats,
                         max_seq_length=seq,
                         token_cap=token_cap(max_batch_tokens, seq) if max_batch_tokens else None)
    size, best = 1, 0.0
    while True:
        try:
            step = measure(handler, size, repeats, clock)
        except Exception as exc:
            if not is_oom(exc):
                raise
            handler.release_memory()
            result.steps.append(Step(size, oom=True))
            result.stopped = f"out of memory at {size}"
            return result
        result.steps.append(step)
        if size > 1 and step.items_per_s < best * (1 + min_gain):
            result.stopped = f"items/s grew less than {min_gain:.0%} from {size // 2} to {size}"
            return result
        best = max(best, step.items_per_s)
        if size * 2 > limit:
            result.stopped = f"reached --limit {limit}"
            return result
        size *= 2


def plot(result: Calibration, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [s for s in result.steps if not s.oom]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s.batch_size for s in ran], [s.items_per_s for s in ran], "o-", label="items/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("items/s")
    ax.axvline(result.max_batch_size, color="green", linestyle="--",
               label=f"recommended max_batch_size {result.max_batch_size}")
    for s in result.steps:
        if s.oom:
            ax.axvline(s.batch_size, color="red", linestyle=":", label=f"OOM at {s.batch_size}")
    twin = ax.twinx()
    twin.plot([s.batch_size for s in ran], [s.ms_per_batch for s in ran], "s--", color="grey",
              label="ms per batch")
    twin.set_ylabel("ms per batch")
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
    ax.set_title(f"{result.model} on {result.device}: {result.stopped}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def noise_warning(result: Calibration) -> str:
    worst = max(result.noisy, key=lambda s: s.spread)
    sizes = ", ".join(str(s.batch_size) for s in result.noisy)
    return (f"warning: the timings are too noisy to trust (batch sizes {sizes}: at "
            f"{worst.batch_size}, the slowest of {result.repeats} calls took "
            f"{worst.spread:.0%} longer than the fastest; more than {NOISY:.0%} means other "
            "work was running). Run it again on an idle machine, or with more --repeats, "
            "before using the recommendation above.")


def _arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a model of the models file")
    p.add_argument("--models-file", help="default: the configured one (IQ_MODELS_FILE)")
    p.add_argument("--limit", type=int, default=4096, help="largest batch to try")
    p.add_argument("--min-gain", type=float, default=0.05,
                   help="stop when doubling the batch raises items/s by less than this")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per batch size")
    p.add_argument("--plot", default=None,
                   help="PNG to write (default bench/results/calibration-MODEL.png)")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    p.add_argument("--save", action="store_true",
                   help="write the answer to the calibration file (calibration_file), the "
                        "model's max batch on a GPU unless the models file declares one")
    return p


def _report(result, model: str, plot_path: Path, max_batch_tokens: int) -> None:
    print(f"{'batch':>6} {'ms/batch':>10} {'items/s':>10} {'peak MB':>9}")
    for s in result.steps:
        if s.oom:
            print(f"{s.batch_size:>6} {'out of memory':>21}")
            continue
        peak = f"{s.peak_memory_mb:.0f}" if s.peak_memory_mb is not None else "-"
        print(f"{s.batch_size:>6} {s.ms_per_batch:>10.2f} {s.items_per_s:>10.1f} {peak:>9}")
    plot(result, plot_path)
    print(f"stopped: {result.stopped}; largest safe batch: {result.largest_safe}")
    print(f"recommended for {model} on {result.device}:")
    capped = (f" (capped by max_batch_tokens {max_batch_tokens} / max sequence "
              f"length {result.max_seq_length})" if result.token_cap is not None
              and result.token_cap < int(0.8 * result.largest_safe) else "")
    print(f"  max_batch_size: {result.max_batch_size}{capped}")
    print(f"  max_wait_ms: {result.max_wait_ms:g}")
    print(f"plot: {plot_path}")
    if result.noisy:
        print(noise_warning(result), file=sys.stderr)


def _save(result, model: str, settings) -> None:
    path = calibration_path(settings)
    save_answer(path, model, {
        "device": result.device, "largest_safe": result.largest_safe,
        "max_batch_size": result.max_batch_size, "max_seq_length": result.max_seq_length,
        "max_wait_ms": result.max_wait_ms, "stopped": result.stopped,
        "noisy": [s.batch_size for s in result.noisy],
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    print(f"saved to {path}: {model}'s max batch on a GPU unless the models file "
          f"declares one" if result.device.startswith("cuda") else
          f"saved to {path}, measured on {result.device}: a worker takes only an answer "
          f"measured on a GPU (rerun it there)")


def main(argv: list[str] | None = None) -> int:
    p = _arguments()
    a = p.parse_args(argv)

    from workers.child.devices import configure_allocator, device_for
    from workers.child.runtime import load_handler

    settings = load_settings({"models_file": a.models_file} if a.models_file else None)
    models = load_models(settings.models_file)
    if a.model not in models:
        p.error(f"unknown model {a.model!r}; known: {', '.join(sorted(models))}")
    spec = models[a.model]
    configure_allocator(settings)
    handler = load_handler(spec, device_for(spec, 0), settings, spec.memory_fraction)
    result = calibrate(handler, a.limit, a.min_gain, a.repeats,
                       max_batch_tokens=settings.max_batch_tokens)
    if a.plot:
        plot_path = Path(a.plot)
    else:
        RESULTS.mkdir(parents=True, exist_ok=True)
        plot_path = RESULTS / f"calibration-{a.model}.png"
    _report(result, a.model, plot_path, settings.max_batch_tokens)
    if a.save:
        _save(result, a.model, settings)
    if a.json:
        print(json.dumps({**asdict(result), "max_batch_size": result.max_batch_size,
                          "max_wait_ms": result.max_wait_ms,
                          "noisy": [s.batch_size for s in result.noisy]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
