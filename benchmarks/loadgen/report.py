"""A run's result on the terminal (a table), as JSON, and as a PNG (needs matplotlib).

The PNG has the CDFs of TTFT, TPOT and ITL, and every inter-token gap against the time its
token arrived (stalls, and the queue building up, show there).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.loadgen.client import RequestResult
from benchmarks.outputs import pyplot


def summary_table(summary: dict[str, Any], phases: dict[str, Any] | None = None) -> str:
    lines = ["============ Serving Benchmark Result ============"]

    def row(name: str, value: Any, fmt: str = "{:.2f}") -> None:
        text = "-" if value is None else (fmt.format(value) if fmt else str(value))
        lines.append(f"{name:<40}{text:>10}")

    row("Requests (completed / failed)", f"{summary['completed']} / {summary['failed']}", "")
    for kind, count in summary["errors"].items():
        row(f"  failed: {kind[:30]}", count, "{}")
    row("Benchmark duration (s)", summary["duration_s"])
    row("Request throughput (req/s)", summary["request_throughput"])
    row("Output token throughput (tok/s)", summary["output_throughput"])
    row("Total token throughput (tok/s)", summary["total_token_throughput"])
    if "goodput" in summary:
        slo = " ".join(f"{k.removesuffix('_ms')}:{v:g}" for k, v in summary["slo"].items())
        row(f"Goodput (req/s) [{slo} ms]", summary["goodput"])
        row("SLO attainment (of all requests)", summary["attainment"] * 100, "{:.1f}%")
    for key, title in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2el_ms", "E2E latency"),
    ):
        dist = summary[key]
        lines.append(f"{'-' * 18}{title + ' (ms)':^14}{'-' * 18}")
        for stat in ("mean", "p50", "p90", "p95", "p99"):
            row(f"{stat}", dist[stat])
    lag = summary["send_lag_ms"]
    row("Client send lag p99 (ms)", lag["p99"])
    if phases:
        lines.append(f"{'-' * 10}{'Server timing phases (ms)':^30}{'-' * 10}")
        lines.append(f"{'phase':<32}{'p50':>9}{'p99':>9}")
        for name, stats in phases.items():
            lines.append(f"{name:<32}{stats['p50']:>9.2f}{stats['p99']:>9.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))


def plot_run(path: Path, results: list[RequestResult], title: str) -> bool:
    """Write the run's PNG; False (and nothing written) when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    done = [r for r in results if r.success]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    series = (
        (axes[0][0], "TTFT (ms)", [r.ttft * 1000 for r in done if r.ttft is not None]),
        (axes[0][1], "TPOT (ms)", [t * 1000 for r in done if (t := r.tpot) is not None]),
        (axes[1][0], "ITL (ms)", [g * 1000 for r in done for g in r.itl]),
    )
    for ax, label, values in series:
        _cdf(ax, values, label)
    ax = axes[1][1]
    times, gaps = [], []
    for r in done:
        t = (r.sent or 0.0) + (r.ttft or 0.0)
        for gap in r.itl:
            t += gap
            times.append(t)
            gaps.append(gap * 1000)
    ax.scatter(times, gaps, s=1, alpha=0.3)
    ax.set_xlabel("time since the run started (s)")
    ax.set_ylabel("ITL (ms)")
    ax.set_yscale("log")
    ax.set_title("inter-token gaps over time")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _cdf(ax, values: list[float], label: str) -> None:
    ordered = sorted(values)
    if ordered:
        n = len(ordered)
        ax.plot(ordered, [(i + 1) / n for i in range(n)])
    ax.set_xlabel(label)
    ax.set_ylabel("fraction of requests" if "ITL" not in label else "fraction of gaps")
    ax.set_title(f"CDF of {label.split()[0]}")
    ax.grid(alpha=0.3)
