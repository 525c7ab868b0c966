"""The arithmetic of benchmarks/routing_compare.py: prefill counters read from a real /metrics
body, the hit rate of a run between two scrapes, and the comparison table."""

from __future__ import annotations

from benchmarks.routing_compare import PolicyResult, hit_rate, prefill_counters, table
from router.metrics import NodeCollector, RouterMetrics


def metrics_text(hits: int, queries: int, dispatched: int) -> str:
    metrics = RouterMetrics("smol")
    nodes = [
        ("tcp://p:1", "prefill", True, {}, {"prefix_cache_hits": hits, "prefix_cache_queries": queries}),
        ("tcp://p:2", "prefill", True, {}, {"prefix_cache_hits": 0, "prefix_cache_queries": 100}),
        ("tcp://d:1", "decode", True, {}, {"prefix_cache_hits": 999, "prefix_cache_queries": 999}),
    ]  # fmt: skip
    metrics.add_collector(NodeCollector("smol", lambda: nodes))
    for _ in range(dispatched):
        metrics.dispatched(10, [("tcp://p:1", "prefill"), ("tcp://d:1", "decode")])
    return metrics.render()


def test_counters_are_read_per_prefill_node_and_decode_nodes_are_left_out():
    counters = prefill_counters(metrics_text(hits=300, queries=500, dispatched=3))
    assert counters == {
        "tcp://p:1": {"hits": 300, "queries": 500, "requests": 3},
        "tcp://p:2": {"hits": 0, "queries": 100, "requests": 0},
    }


def test_the_hit_rate_counts_only_what_happened_between_the_scrapes():
    before = prefill_counters(metrics_text(hits=100, queries=200, dispatched=0))
    after = prefill_counters(metrics_text(hits=400, queries=800, dispatched=5))
    assert hit_rate(before, after) == 0.5  # (400 - 100) / (900 - 300)
    assert hit_rate(after, after) is None


def test_the_table_puts_the_policies_side_by_side():
    rows = [
        PolicyResult("round_robin", 10, 0, 0.25, 120.0, 480.0, 150.0, 33.3, {"a": 5, "b": 5}),
        PolicyResult("cache_aware", 10, 0, 0.75, 60.0, 200.0, 70.0, 35.0, {"a": 7, "b": 3}),
    ]
    lines = table(rows).splitlines()
    assert "hit rate" in lines[0] and "TTFT p99" in lines[0]
    assert "25.0%" in lines[1] and "480.0" in lines[1] and lines[1].endswith("5 5")
    assert "75.0%" in lines[2] and "60.0" in lines[2] and lines[2].endswith("7 3")
