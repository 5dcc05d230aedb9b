"""Targets (ratios measured side by side in one run), the plot, and the README table."""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

START, END = "<!-- results:start -->", "<!-- results:end -->"


def _point(report: dict, model: str, config: str, clients: int) -> dict | None:
    entry = report["models"].get(model, {}).get("configs", {}).get(config)
    if not entry:
        return None
    return next((p for p in entry["sweep"] if p["clients"] == clients), None)


def _raw(report: dict, model: str, point: str) -> dict | None:
    """The raw model beside the `point` ("lone": batch 1, "16 clients": batch 16, "multi": the
    largest batch): as measured in the same rounds as the services where it was, else from
    the sweep."""
    raw = report["models"].get(model, {}).get("raw", {})
    measured = (raw.get("side_by_side") or {}).get(point)
    rows = raw.get("batches") or []
    if measured or not rows:
        return measured
    if point == "16 clients":
        return next((r for r in rows if r["batch_size"] == 16), None)
    return rows[0] if point == "lone" else rows[-1]


def evaluate_targets(report: dict) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def target(name: str, value: float | None, limit: float, op: str, detail: str) -> None:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return
        ok = value <= limit if op == "<=" else value >= limit
        out.append({"name": name, "value": round(value, 3), "limit": limit, "op": op,
                    "pass": ok, "detail": detail})

    m = "minilm-embed"
    svc1, off1 = _point(report, m, "service", 1), _point(report, m, "no-batching", 1)
    raw1 = _raw(report, m, "lone")
    if svc1 and raw1:
        overhead = svc1["p50_ms"] - raw1["call_ms"]
        target("lone job: p50 - raw batch-1 time (ms)", overhead, 10, "<=",
               f"p50 {svc1['p50_ms']:.1f} ms, raw batch-1 {raw1['call_ms']:.1f} ms")
    if svc1 and off1:
        target("1-client p99: batching on / off", svc1["p99_ms"] / off1["p99_ms"], 1.1, "<=",
               f"{svc1['p99_ms']:.1f} ms vs {off1['p99_ms']:.1f} ms")
    svc16, off16 = _point(report, m, "service", 16), _point(report, m, "no-batching", 16)
    if svc16 and off16:
        target("minilm 16 clients: items/s vs batching off",
               svc16["items_per_s"] / off16["items_per_s"], 2.5, ">=",
               f"{svc16['items_per_s']:.0f} vs {off16['items_per_s']:.0f} items/s")
    peer1 = _point(report, m, "celery-batches-tuned", 1)
    peer16 = _point(report, m, "celery-batches-tuned", 16)
    if svc1 and peer1:
        target("lone p50 vs celery-batches tuned", svc1["p50_ms"] / peer1["p50_ms"], 0.5, "<=",
               f"{svc1['p50_ms']:.1f} ms vs {peer1['p50_ms']:.1f} ms")
    if svc16 and peer16:
        target("minilm 16 clients: items/s vs celery-batches tuned",
               svc16["items_per_s"] / peer16["items_per_s"], 1.2, ">=",
               f"{svc16['items_per_s']:.0f} vs {peer16['items_per_s']:.0f} items/s")
    s64, o64 = _point(report, "synthetic", "service", 64), _point(report, "synthetic",
                                                                   "no-batching", 64)
    if s64 and o64:
        target("synthetic 64 clients: items/s vs batching off",
               s64["items_per_s"] / o64["items_per_s"], 4, ">=",
               f"{s64['items_per_s']:.0f} vs {o64['items_per_s']:.0f} items/s")
    multi = report["models"].get(m, {}).get("configs", {}).get("service", {}).get("multi")
    raw_max = _raw(report, m, "multi")
    if multi and raw_max:
        target("32-input jobs: items/s vs raw ceiling at max batch",
               multi["items_per_s"] / raw_max["items_per_s"], 0.85, ">=",
               f"{multi['items_per_s']:.0f} vs {raw_max['items_per_s']:.0f} items/s "
               f"(batch {raw_max['batch_size']})")
    _issue14_targets(report, target)
    rss = report["models"].get("synthetic", {}).get("configs", {}).get("service", {}).get("rss")
    if rss:
        target(f"API RSS growth over {rss['jobs']} jobs (MB)", rss["growth_mb"], 50, "<=",
               f"{rss['rss_before_mb']:.0f} → {rss['rss_after_mb']:.0f} MB")
    return out


def _issue14_targets(report: dict, target) -> None:
    """The queue path's cost against an earlier commit (`--baseline`), measured in the same
    run: as that commit's benchmark ran it (POST, then GET ?wait) and with the same
    one-request clients as this service; and the service against its raw model."""
    syn, m = "synthetic", "minilm-embed"
    lone, raw1 = _point(report, syn, "service", 1), _raw(report, syn, "lone")
    if lone and raw1:
        target("synthetic lone job: p50 - raw batch-1 time (ms)",
               lone["p50_ms"] - raw1["call_ms"], 5, "<=",
               f"p50 {lone['p50_ms']:.1f} ms, raw batch-1 {raw1['call_ms']:.1f} ms")
    svc16, raw16 = _point(report, m, "service", 16), _raw(report, m, "16 clients")
    if svc16 and raw16:
        target("minilm 16 clients: items/s vs raw model at batch 16",
               svc16["items_per_s"] / raw16["items_per_s"], 0.5, ">=",
               f"{svc16['items_per_s']:.0f} vs {raw16['items_per_s']:.0f} items/s")
    rev = report.get("baseline")
    if not rev:
        return
    for name, how in ((rev, "as it ran: POST, GET ?wait"),
                      (f"{rev} prefer-wait", "same one-request clients")):
        cpu, old = _point(report, syn, "service", 16), _point(report, syn, name, 16)
        if cpu and old and "queue_path_cpu_ms_per_job" in old:
            target(f"synthetic 16 clients: queue-path CPU per job vs {rev} ({how})",
                   cpu["queue_path_cpu_ms_per_job"] / old["queue_path_cpu_ms_per_job"], 0.5,
                   "<=", f"{cpu['queue_path_cpu_ms_per_job']:.2f} vs "
                         f"{old['queue_path_cpu_ms_per_job']:.2f} ms")
        new64, old64 = _point(report, syn, "service", 64), _point(report, syn, name, 64)
        if new64 and old64:
            target(f"synthetic 64 clients: items/s vs {rev} ({how})",
                   new64["items_per_s"] / old64["items_per_s"], 2, ">=",
                   f"{new64['items_per_s']:.0f} vs {old64['items_per_s']:.0f} items/s")


def ceiling(report: dict, model: str) -> dict | None:
    """The raw model's best rate in its sweep: the most any configuration could reach."""
    rows = report["models"].get(model, {}).get("raw", {}).get("batches") or []
    return max(rows, key=lambda r: r["items_per_s"]) if rows else None


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(report["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for name, entry in report["models"][model]["configs"].items():
            xs = [p["items_per_s"] for p in entry["sweep"]]
            line, = ax.plot(xs, [p["p50_ms"] for p in entry["sweep"]], "o-", label=f"{name} p50")
            ax.plot(xs, [p["p99_ms"] for p in entry["sweep"]], "x--", color=line.get_color(),
                    label=f"{name} p99")
            for p in entry["sweep"]:
                ax.annotate(str(p["clients"]), (p["items_per_s"], p["p50_ms"]), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
        top = ceiling(report, model)
        if top:
            ax.axvline(top["items_per_s"], color="black", linestyle=":", linewidth=1.2,
                       label=f"raw model ceiling: {top['items_per_s']:.0f} items/s "
                             f"(batch {top['batch_size']}, in-process)")
        ax.set_title(f"{model} (labels: concurrent clients)")
        ax.set_xlabel("throughput (items/s)")
        ax.set_ylabel("end-to-end latency (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"inference-queue benchmark {report['started']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cpu(point: dict) -> str:
    """CPU per job of the queue path's processes and Redis's commands per job (two cells)."""
    cpu = point.get("cpu_ms_per_job")
    if not cpu:
        return " | "
    return (f"{cpu['api']:.2f}, {cpu['worker main']:.2f}, {cpu['redis']:.2f} "
            f"({point['queue_path_cpu_ms_per_job']:.2f}) | "
            f"{point['redis_commands_total_per_job']:.1f}")


def _busy(point: dict) -> str:
    """The device's busy share while work waited (workers/child/handlers/busy.py); - for a worker
    that does not measure it (an earlier commit, the celery-batches peer)."""
    share = point.get("device_busy_share")
    return "-" if share is None else f"{share:.2f}"


def render_table(report: dict) -> str:
    lines = []
    for model, entry in report["models"].items():
        raw = ", ".join(f"b{r['batch_size']} {r['items_per_s']:.0f}/s ({r['call_ms']:.1f} ms)"
                        for r in entry["raw"]["batches"])
        lines += [f"### {model}", "", f"Raw model ceiling (in-process): {raw}", ""]
        for what, r in (entry["raw"].get("side_by_side") or {}).items():
            lines += [f"Raw model in the same rounds as the {what} point: batch "
                      f"{r['batch_size']}, {r['items_per_s']:.0f}/s ({r['call_ms']:.1f} ms a "
                      f"call; rounds {r['rounds_items_per_s']})", ""]
        lines += ["| configuration | clients | items/s | p50 ms | p99 ms | CPU ms/job: API, "
                  "worker main, Redis (queue path) | Redis commands/job | device busy |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name, cfg in entry["configs"].items():
            for p in cfg["sweep"]:
                lines.append(f"| {name} | {p['clients']} | {p['items_per_s']:.0f} | "
                             f"{p['p50_ms']:.1f} | {p['p99_ms']:.1f} | {_cpu(p)} | "
                             f"{_busy(p)} |")
            multi = cfg["multi"]
            lines.append(f"| {name} | {multi['clients']} × 32-input jobs | "
                         f"{multi['items_per_s']:.0f} | {multi['p50_ms']:.1f} | "
                         f"{multi['p99_ms']:.1f} | {_cpu(multi)} | {_busy(multi)} |")
        lines.append("")
    lines += ["### Targets", "", "| target | measured | limit | |", "|---|---:|---:|---|"]
    for t in report["targets"]:
        lines.append(f"| {t['name']} ({t['detail']}) | {t['value']} | {t['op']} {t['limit']} | "
                     f"{'pass' if t['pass'] else '**miss**'} |")
    return "\n".join(lines)


def render_readme(report: dict, readme: Path, plot_path: str) -> None:
    m = report["machine"]
    block = "\n".join([
        START,
        f"Run {report['started']} with `{report['command']}` on {m['cpus']} CPUs, "
        f"{m['memory_gb']} GiB, {m['platform']}, Python {m['python']}; no GPU. "
        + (f"Each point: {method['rounds']} rounds of {method['seconds_per_round']:g} s, "
           f"configurations side by side; clients: {method['flow']}."
           if (method := report.get("method")) else ""),
        "", f"![throughput against latency]({plot_path})", "", render_table(report), END])
    text = readme.read_text() if readme.exists() else f"{START}\n{END}\n"
    text = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _m: block, text,
                  flags=re.S)
    readme.write_text(text)
