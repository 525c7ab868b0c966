"""Aggregate request results: latency percentiles, throughput, SLO goodput, server phases.

Definitions follow `vllm bench serve`: TTFT, TPOT = (E2E - TTFT) / (output tokens - 1), ITL =
every gap between token chunks, E2E latency; percentiles by linear interpolation (`SLO` and
`percentile` live in `pdserve.workload.slo`, which the planner shares); goodput =
completed requests that meet every given SLO, per second of benchmark duration. Attainment
(for rate sweeps) is the same count over every request planned, failed ones included.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from benchmarks.loadgen.client import RequestResult
from pdserve.workload.slo import SLO, percentile

__all__ = ["SLO", "distribution", "percentile", "server_phases", "summarize"]

PERCENTILES = (50, 90, 95, 99)


def distribution(values: Iterable[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean and p50/p90/p95/p99, times `scale` (seconds -> ms by default); None when empty."""
    data = [v * scale for v in values]
    out: dict[str, float | None] = {"mean": sum(data) / len(data) if data else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(data, q) if data else None
    return out


def summarize(
    results: Sequence[RequestResult], duration_s: float, slo: SLO | None = None
) -> dict[str, Any]:
    """The run's summary. `results` holds every planned request, sent or not."""
    done = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens or 0 for r in done)
    duration = max(duration_s, 1e-9)
    out: dict[str, Any] = {
        "requests": len(results),
        "completed": len(done),
        "failed": len(failed),
        "errors": _error_counts(failed),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (output + prompt) / duration,
        "total_output_tokens": output,
        "total_prompt_tokens": prompt,
        "ttft_ms": distribution(r.ttft for r in done),
        "tpot_ms": distribution(t for r in done if (t := r.tpot) is not None),
        "itl_ms": distribution(g for r in done for g in r.itl),
        "e2el_ms": distribution(r.e2e for r in done),
        "send_lag_ms": distribution(
            r.sent - r.scheduled - r.queue_wait for r in results if r.sent is not None
        ),
    }
    if slo:
        good = sum(1 for r in done if slo.met(r))
        out["slo"] = slo.to_dict()
        out["slo_misses"] = slo.misses(done)
        out["goodput"] = good / duration
        out["good_requests"] = good
        out["attainment"] = good / len(results) if results else 0.0
    return out


def _error_counts(failed: Iterable[RequestResult]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in failed:
        key = (r.error or "unknown").split(":", 1)[0]
        counts[key] = counts.get(key, 0) + 1
    return counts


def server_phases(results: Sequence[RequestResult]) -> dict[str, dict[str, float | None]]:
    """p50/p99 (ms) of every scalar phase in the servers' timing records, over completed
    requests, plus the client's TTFT minus the server's (HTTP, SSE and client time)."""
    values: dict[str, list[float]] = {}
    for r in results:
        if not r.success or not r.timing:
            continue
        for key, value in r.timing.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values.setdefault(key, []).append(float(value))
        intervals = r.timing.get("decode_intervals")
        if isinstance(intervals, dict) and isinstance(intervals.get("p99"), (int, float)):
            values.setdefault("decode_interval_p99", []).append(float(intervals["p99"]))
        server_ttft = r.timing.get("ttft")
        if isinstance(server_ttft, (int, float)) and r.ttft is not None:
            values.setdefault("client_minus_server_ttft", []).append(r.ttft - server_ttft)
    out = {}
    for key, data in sorted(values.items()):
        ms = [v * 1000 for v in data]
        out[key] = {
            "count": len(ms),
            "p50": percentile(ms, 50),
            "p90": percentile(ms, 90),
            "p99": percentile(ms, 99),
        }
    return out
