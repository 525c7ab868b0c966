"""The periodic stats line the router logs while there is traffic (`--stats-interval`).

    stats: 3.0 req/s, prompt 410.2 tok/s, generation 95.1 tok/s; running 4, waiting 1;
    KV use 12.5%; prefix hit rate 40.0%

Throughput is the change of the router's counters since the previous line; running, waiting
and KV use are the sums over the nodes' last heartbeats; the prefix hit rate is over the
prompt blocks the nodes looked up in their prefix caches since they started.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("router.stats")


@dataclass(frozen=True)
class Totals:
    requests: float
    prompt_tokens: float
    generation_tokens: float


def _sum(counter: Any) -> float:
    """A prometheus_client counter's total over all its label sets."""
    return float(
        sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))
    )


def totals(metrics: Any) -> Totals:
    return Totals(
        _sum(metrics.requests), _sum(metrics.prompt_tokens), _sum(metrics.generation_tokens)
    )


def stats_line(
    before: Totals,
    after: Totals,
    seconds: float,
    loads: list[dict[str, Any]],
    kv_pools: list[tuple[dict[str, Any], dict[str, Any]]],
) -> str:
    """One line from two counter snapshots `seconds` apart, every node's load, and the
    (info, load) of the nodes whose KV pool holds running requests (decode / colocated)."""

    def rate(a: float, b: float) -> float:
        return (b - a) / seconds if seconds > 0 else 0.0

    running = sum(int(load.get("running", 0)) for load in loads)
    waiting = sum(int(load.get("waiting", 0)) for load in loads)
    total = sum(int(info.get("num_kv_blocks", 0)) for info, _ in kv_pools)
    free = sum(int(load.get("free_blocks", 0)) for _, load in kv_pools)
    queried = sum(int(load.get("prefix_queried_blocks", 0)) for load in loads)
    hits = sum(int(load.get("prefix_hit_blocks", 0)) for load in loads)
    kv_use = f"{100.0 * (total - free) / total:.1f}%" if total else "n/a"
    hit_rate = f"{100.0 * hits / queried:.1f}%" if queried else "n/a"
    return (
        f"stats: {rate(before.requests, after.requests):.1f} req/s, "
        f"prompt {rate(before.prompt_tokens, after.prompt_tokens):.1f} tok/s, "
        f"generation {rate(before.generation_tokens, after.generation_tokens):.1f} tok/s; "
        f"running {running}, waiting {waiting}; KV use {kv_use}; prefix hit rate {hit_rate}"
    )


async def log_stats_forever(core: Any, interval: float) -> None:
    """Log a stats line every `interval` seconds unless nothing happened and nothing runs."""
    before, then = totals(core.metrics), core.clock()
    while True:
        await asyncio.sleep(interval)
        now, after = core.clock(), totals(core.metrics)
        nodes = [n for n in core.registry.nodes.values() if n.alive]
        loads = [n.load or {} for n in nodes]
        if after != before or any(load.get("running") or load.get("waiting") for load in loads):
            pools = [(n.info or {}, n.load or {}) for n in nodes if n.role != "prefill"]
            log.info(stats_line(before, after, now - then, loads, pools))
        before, then = after, now
