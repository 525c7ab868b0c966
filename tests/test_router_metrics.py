"""The router's Prometheus metrics: vLLM-style names with a model_name label, histograms from
timing records, and per-node series from the heartbeats."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

from router.metrics import NodeCollector, RouterMetrics
from router.stats import Totals, totals
from router.timing import TimingMarks, assemble
from tests.router_fakes import metric

SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_]+="([^"\\]|\\.)*",?)*\})? \S+$')


def finished_request() -> TimingMarks:
    marks = TimingMarks(arrival=0.0, dispatched=0.001)
    marks.merge_node_timing({"prefill_queue": 0.01, "prefill_compute": 0.02, "kv_transfer": 0.003})
    for t in (0.05, 0.06, 0.08):
        marks.tokens_arrived(t)
    marks.finished = 0.08
    return marks


def test_a_finished_request_is_recorded_in_every_histogram_under_its_model_name():
    metrics = RouterMetrics("smol")
    metrics.request_done(200, assemble(finished_request(), 0.08), 3, finish_reasons=["stop"])
    metrics.request_done(400, None, 0)
    text = metrics.render()
    m = {"model_name": "smol"}
    assert metric(text, "pdserve:requests_total", status="200", **m) == 1
    assert metric(text, "pdserve:requests_total", status="400", **m) == 1
    assert metric(text, "pdserve:request_success_total", finished_reason="stop", **m) == 1
    assert metric(text, "pdserve:generation_tokens_total", **m) == 3
    assert metric(text, "pdserve:time_to_first_token_seconds_count", **m) == 1
    assert metric(text, "pdserve:time_to_first_token_seconds_sum", **m) == 0.05
    assert metric(text, "pdserve:inter_token_latency_seconds_count", **m) == 2
    assert metric(text, "pdserve:e2e_request_latency_seconds_count", **m) == 1
    assert metric(text, "pdserve:request_queue_time_seconds_sum", **m) == 0.01
    assert metric(text, "pdserve:request_prefill_time_seconds_sum", **m) == 0.02
    for phase in ("kv_transfer", "first_token_delivery", "router_queue_tokenize"):
        assert metric(text, "pdserve:request_phase_seconds_count", phase=phase, **m) == 1


def test_histogram_buckets_are_cumulative():
    metrics = RouterMetrics("smol")
    for ttft in (0.004, 0.2, 30.0):
        marks = TimingMarks(arrival=0.0, dispatched=0.0)
        marks.tokens_arrived(ttft)
        metrics.request_done(200, assemble(marks, ttft), 1)
    text = metrics.render()
    name = "pdserve:time_to_first_token_seconds_bucket"
    assert metric(text, name, le="0.005") == 1
    assert metric(text, name, le="0.25") == 2
    assert metric(text, name, le="60.0") == 3
    assert metric(text, name, le="+Inf") == 3


def test_dispatches_count_per_node_and_in_flight_returns_to_zero():
    metrics = RouterMetrics("smol")
    metrics.dispatched(10, [("tcp://p:1", "prefill"), ("tcp://d:1", "decode")])
    assert metric(metrics.render(), "pdserve:router_requests_in_flight") == 1
    metrics.released()
    text = metrics.render()
    assert metric(text, "pdserve:router_requests_in_flight") == 0
    assert metric(text, "pdserve:prompt_tokens_total") == 10
    assert metric(text, "pdserve:node_requests_total", node="tcp://d:1", role="decode") == 1


def test_node_series_come_from_the_last_heartbeat_of_each_node():
    metrics = RouterMetrics("smol")
    nodes = [
        ("tcp://p:1", "prefill", True, {"num_kv_blocks": 100},
         {"running": 2, "waiting": 1, "used_blocks": 25, "prefix_cache_queries": 640,
          "prefix_cache_hits": 320, "kv_transfer_failures": 1}),
        ("tcp://d:1", "decode", False, {"num_kv_blocks": 50},
         {"running": 7, "used_blocks": 50, "kv_transfer_bytes": 4096, "kv_transfer_seconds": 0.5,
          "kv_late_frames": 3, "preemptions": 2, "invalid_messages": 4, "draining": True}),
    ]  # fmt: skip
    metrics.add_collector(NodeCollector("smol", lambda: nodes))
    text = metrics.render()
    p = {"model_name": "smol", "node": "tcp://p:1", "role": "prefill"}
    d = {"model_name": "smol", "node": "tcp://d:1", "role": "decode"}
    assert metric(text, "pdserve:node_healthy", **p) == 1
    assert metric(text, "pdserve:node_healthy", **d) == 0
    assert metric(text, "pdserve:num_requests_running", **p) == 2
    assert metric(text, "pdserve:num_requests_waiting", **p) == 1
    assert metric(text, "pdserve:num_requests_waiting", **d) is None  # not reported
    assert metric(text, "pdserve:kv_cache_usage_perc", **p) == 0.25
    assert metric(text, "pdserve:kv_cache_usage_perc", **d) == 1.0
    assert metric(text, "pdserve:prefix_cache_queries_total", **p) == 640
    assert metric(text, "pdserve:prefix_cache_hits_total", **p) == 320
    assert metric(text, "pdserve:kv_transfer_bytes_total", **d) == 4096
    assert metric(text, "pdserve:kv_transfer_seconds_total", **d) == 0.5
    assert metric(text, "pdserve:kv_transfer_failures_total", **p) == 1
    assert metric(text, "pdserve:kv_late_frames_total", **d) == 3
    assert metric(text, "pdserve:num_preemptions_total", **d) == 2
    assert metric(text, "pdserve:invalid_messages_total", **d) == 4


def test_the_exposition_parses_and_every_line_is_a_comment_or_a_sample():
    metrics = RouterMetrics("smol")
    metrics.request_done(200, assemble(finished_request(), 0.08), 3, finish_reasons=["stop"])
    metrics.add_collector(NodeCollector("smol", lambda: [("n", "decode", True, {}, {})]))
    text = metrics.render()
    assert text.endswith("\n")
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"pdserve:time_to_first_token_seconds", "pdserve:node_healthy"} <= names
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or SAMPLE.match(line), line


def test_the_stats_line_totals_read_the_prometheus_counters():
    # The stats task starts with totals(): it raised AttributeError on prometheus_client
    # counters, so the task died at start-up and no stats line was ever logged.
    metrics = RouterMetrics("m")
    assert totals(metrics) == Totals(0.0, 0.0, 0.0)
    metrics.dispatched(12, [("tcp://p", "prefill")])
    metrics.request_done(200, None, 5, ["length"])
    metrics.request_done(400, None, 0)
    assert totals(metrics) == Totals(2.0, 12.0, 5.0)
