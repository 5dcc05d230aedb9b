"""A game day's report in the terminal, and its picture: every job's latency over the run, p50
and p99 per 5 s, each fault's window shaded and named, jobs never answered marked on top."""
from __future__ import annotations

import math
import os
from pathlib import Path

from bench.gameday.ledger import LIMITS, PHASES


def _n(value, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def _lat(spread: dict) -> str:
    return "/".join(_n(spread[k]) for k in ("p50_ms", "p99_ms", "p99_9_ms"))


def _cpu(report: dict) -> str:
    """The machine while the run played: CPU (mean) and load average (before, mean, most)."""
    samples = report["cpu"]["samples"]
    if not samples:
        return ""
    machine = sum(row[1] for row in samples) / len(samples)
    stack = sum(row[2] for row in samples) / len(samples)
    loads = [row[3] for row in samples]
    before = "/".join(f"{x:.2f}" for x in report["run"]["load_before"])
    return (f"CPU, mean over the run (100 % = a core, {os.cpu_count()} cores): machine "
            f"{machine:.0f} %, of which the stack {stack:.0f} %; load average (1 min) "
            f"{sum(loads) / len(loads):.1f} mean, {max(loads):.1f} most (before the stack "
            f"started, 1/5/15 min: {before})")


def _served(run: dict) -> str:
    """The model, and the models file when the run was given one (`--models-file`)."""
    return run["model"] + (f" (models file {run['models_file']})" if run.get("models_file")
                           else "")


def table(report: dict) -> str:
    run, jobs = report["run"], report["jobs"]
    lines = [
        f"Game day {run['started']}: {_served(run)}, "
        f"{run['seconds']:.0f} s of arrivals at "
        f"{run['rate']:.1f} jobs/s ({run['rate_source']}), {jobs['arrivals']:,} jobs, "
        f"{len(report['faults'])} fault(s)",
        _cpu(report),
        "",
        f"{'fault':<32}{'at s':>6}{'serving s':>10}{'recovered s':>12}"
        f"{'p50/p99/p99.9 ms inside':>26}{'no id <5s':>10}{'lost':>6}{'5xx':>6}"
        f"{'rerun ok/not':>13}",
    ]
    for f in report["faults"]:
        fivexx = sum(f["server_errors"].values())
        rerun = f"{f['killed_batch_jobs']}/{f['run_twice_unexplained']}"
        lines.append(
            f"{f['label']:<32}{f['at_s']:>6.0f}{_n(f['serving_s'], 1):>10}"
            f"{('never' if f['recovery_s'] is None else _n(f['recovery_s'])):>12}"
            f"{_lat(f['latency']):>26}{f['unavailable']:>10}{f['lost']:>6}{fivexx:>6}"
            f"{rerun:>13}")
    out = report["latency"]["outside_faults"]
    lines += ["", f"outside every fault window: {_lat(out)} ms (p50/p99/p99.9), "
                  f"{out['n']:,} jobs; {_by_inputs(report)}",
              "by phase (p50/p99 ms each; the slowest 1 %: mean ms each): "
              + ", ".join(PHASES)]
    for n, b in report["latency"].get("outside_faults_by_phase", {}).items():
        slow = b["slowest"]
        lines.append(f"  {n:>3} input(s), {b['n']:,} jobs: " + ", ".join(
            f"{ph} {_p50_99(b[ph])}" for ph in PHASES) + f"; slowest {slow['n']} "
            f"({_n(slow['ms'])} ms): " + "/".join(_n(slow[ph]) for ph in PHASES))
    lines += ["per minute of arrival (p50/p99/p99.9 ms, availability):"]
    lines += [f"  {m['minute']:>2}: {_lat(m):>22}  {_n(m['availability'], 4)}"
              for m in report["latency"]["per_minute"]]
    lines += ["", f"answers: {report['answers']}; 5xx answers: "
                  f"{report['server_errors']['answers'] or 'none'}, reaching a caller: "
                  f"{report['server_errors']['reached_caller']}; client retries: "
                  f"{report['client_retries']}",
              f"jobs: {jobs['accepted']:,} accepted, {jobs['succeeded']:,} answered succeeded, "
              f"{jobs['final']:,} final in Redis, "
              f"{jobs['lost']} lost, {jobs['run_twice']} run twice "
              f"({jobs['run_twice_in_killed_batches']} in killed batches); read back after "
              f"waiting {jobs['read_back_waited_s']:.0f} s for late jobs", "", "targets:"]
    for t in report["targets"]:
        verdict = "pass" if t["pass"] else "MISS: " + ", ".join(t["where"])
        lines.append(f"  {t['target']:<46}{_n(t['measured'], 4 if t['limit'] < 1 else 1):>10}"
                     f" {t['op']} {t['limit']:<8} {verdict}")
    return "\n".join(lines)


SHADES = ["orange", "tab:purple"]  # a fault's window; the next one's, told apart


def picture(report: dict, latencies: list[tuple[float, float]], path: Path) -> None:
    """`latencies`: (arrival s, ms or math.inf for a job never answered) per job."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, cpu) = plt.subplots(2, 1, figsize=(14, 8), dpi=110, sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1]})
    answered = [(t, ms) for t, ms in latencies if not math.isinf(ms)]
    ax.scatter([t for t, _ in answered], [ms for _, ms in answered], s=2, alpha=0.15,
               color="tab:blue", linewidths=0, label="a job")
    series = report["series"]
    for column, name, colour in ((1, "p50 per 5 s", "tab:green"), (2, "p99 per 5 s",
                                                                  "tab:red")):
        points = [(row[0] + 2.5, row[column]) for row in series if row[column] is not None]
        ax.plot([t for t, _ in points], [v for _, v in points], color=colour, lw=1.2,
                label=name)
    top = max([ms for _, ms in answered] + [1000]) * 1.5
    never = [t for t, ms in latencies if math.isinf(ms)]
    if never:
        ax.scatter(never, [top] * len(never), marker="x", color="black", s=12,
                   label=f"not answered ({len(never)})")
    ax.axhline(LIMITS["p99_outside_ms"], color="grey", ls="--", lw=1,
               label=f"p99 target {LIMITS['p99_outside_ms']} ms")
    for f, colour in zip(report["faults"], SHADES * len(report["faults"])):
        start, end = f["window_s"]
        ax.axvspan(start, end, color=colour, alpha=0.18)
        ax.axvline(start, color="darkorange", lw=1)
        ax.text(start, top * 1.6, f" {f['label']}", rotation=90, va="top", ha="right",
                fontsize=8, color="saddlebrown")
    run = report["run"]
    bottom = 10 ** math.floor(math.log10(max(min([ms for _, ms in answered] + [10]), 1)))
    ax.set(yscale="log", ylim=(bottom, top * 2), xlim=(0, run["seconds"] + 1),
           ylabel="end-to-end latency (ms)",
           title=f"Game day: {run['model']} at {run['rate']:.1f} jobs/s, "
                 f"{report['jobs']['arrivals']:,} jobs; fault windows shaded")
    ax.legend(loc="upper left", bbox_to_anchor=(1.04, 1), fontsize=8)
    samples = report["cpu"]["samples"]
    for column, name, colour in ((1, "machine, all processes", "grey"),
                                 (2, "the stack's processes", "tab:blue")):
        cpu.plot([row[0] for row in samples], [row[column] for row in samples], lw=1,
                 color=colour, label=name)
    for f, colour in zip(report["faults"], SHADES * len(report["faults"])):
        cpu.axvspan(*f["window_s"], color=colour, alpha=0.18)
    cpu.set(ylabel="CPU (100 % = a core)", xlabel="arrival, seconds into the run",
            ylim=(0, None))
    load = cpu.twinx()
    load.plot([row[0] for row in samples], [row[3] for row in samples], lw=1, ls=":",
              color="black", label="load average (1 min), right")
    load.set(ylabel="load average", ylim=(0, None))
    lines, labels = [], []
    for axis in (cpu, load):
        more = axis.get_legend_handles_labels()
        lines, labels = lines + more[0], labels + more[1]
    cpu.legend(lines, labels, loc="upper left", bbox_to_anchor=(1.04, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


START, END = "<!-- gameday:start -->", "<!-- gameday:end -->"


def markdown(report: dict, picture_path: str) -> str:
    """The run as bench/README.md shows it: what ran, the picture, the faults, the minutes
    and the targets."""
    run, jobs = report["run"], report["jobs"]
    out = report["latency"]["outside_faults"]
    rows = [
        f"Run {run['started']} on {run['machine']}: {_served(run)}, "
        f"{run['seconds']:.0f} s of arrivals at {run['rate']:.1f} jobs/s "
        f"({run['rate_source']}), {jobs['arrivals']:,} jobs. {_cpu(report)}.",
        "", f"![latency over the game day, fault windows shaded]({picture_path})", "",
        "| fault | at (s) | serving again after (s) | p99 back under its pre-fault level "
        "after (s) | p50 / p99 / p99.9 in its window (ms) | no id within 5 s | lost | 5xx "
        "answers | may run twice (a killed or cut-off batch) / ran twice besides |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f in report["faults"]:
        rows.append(
            f"| {f['label']} | {f['at_s']:.0f} | {_n(f['serving_s'], 1)} | "
            f"{'never' if f['recovery_s'] is None else _n(f['recovery_s'])} | "
            f"{_lat(f['latency'])} | {f['unavailable']} | {f['lost']} | "
            f"{sum(f['server_errors'].values())} | {f['killed_batch_jobs']} / "
            f"{f['run_twice_unexplained']} |")
    rows += ["", f"Outside every fault window: p50 / p99 / p99.9 {_lat(out)} ms over "
                 f"{out['n']:,} jobs; {_by_inputs(report)}. Per minute of arrival:", "",
             "| minute | jobs | p50 / p99 / p99.9 (ms) | availability |",
             "|---:|---:|---:|---:|"]
    rows += [f"| {m['minute']} | {m['n']:,} | {_lat(m)} | {_n(m['availability'], 4)} |"
             for m in report["latency"]["per_minute"]]
    rows += _phase_rows(report)
    rows += ["", "| target | measured | limit | |", "|---|---:|---:|---|"]
    for t in report["targets"]:
        verdict = "pass" if t["pass"] else "**miss**: " + ", ".join(t["where"])
        rows.append(f"| {t['target']} | {_n(t['measured'], 4 if t['limit'] < 1 else 1)} | "
                    f"{t['op']} {t['limit']} | {verdict} |")
    return "\n".join(rows)


def _by_inputs(report: dict) -> str:
    """Outside the fault windows, by job size: where the p99 comes from."""
    sizes = report["latency"].get("outside_faults_by_inputs", {})
    return "by inputs a job, " + ", ".join(
        f"{n}: {_lat(s)} ms ({s['n']:,})" for n, s in sizes.items()) if sizes else "no sizes"


def _p50_99(spread: dict) -> str:
    return f"{_n(spread['p50_ms'])}/{_n(spread['p99_ms'])}"


def _phase_rows(report: dict) -> list[str]:
    """Outside the fault windows, where a job's time went, by job size."""
    sizes = report["latency"].get("outside_faults_by_phase", {})
    if not sizes:
        return []
    rows = ["", "Outside every fault window, by phase (`late`: the traffic's own lag to a "
                "user's start; `submit`: to `created_at`; `queued`: to `started_at`; `run`: "
                "to `finished_at`; `answer`: to the final answer in hand), p50 / p99 ms, and "
                "where the time of the slowest 1 % went (mean ms):", "",
            "| inputs a job | jobs | " + " | ".join(PHASES) + " | slowest 1 %: jobs, ms, "
            + " / ".join(PHASES) + " |", "|---:|---:|" + "---:|" * (len(PHASES) + 1)]
    for n, b in sizes.items():
        slow = b["slowest"]
        rows.append(f"| {n} | {b['n']:,} | " + " | ".join(
            _p50_99(b[ph]).replace("/", " / ") for ph in PHASES)
            + f" | {slow['n']}, {_n(slow['ms'])}: "
            + " / ".join(_n(slow[ph]) for ph in PHASES) + " |")
    return rows


def render_readme(report: dict, readme: Path, picture_path: str) -> None:
    text = readme.read_text()
    start, end = text.index(START), text.index(END)
    readme.write_text(text[:start] + START + "\n" + markdown(report, picture_path) + "\n"
                      + text[end:])
