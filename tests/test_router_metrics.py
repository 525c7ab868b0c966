"""The Prometheus text exposition format of the router's metrics."""

from __future__ import annotations

import re

from router.metrics import Counter, Gauge, Histogram, RouterMetrics, render
from router.timing import TimingMarks, assemble

SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_]+="([^"\\]|\\.)*",?)*\})? \S+$')


def test_counter_renders_help_type_and_labelled_samples():
    counter = Counter("x_requests_total", "Requests.")
    counter.inc(status="200")
    counter.inc(2, status="503")
    assert render([counter]).splitlines() == [
        "# HELP x_requests_total Requests.",
        "# TYPE x_requests_total counter",
        'x_requests_total{status="200"} 1',
        'x_requests_total{status="503"} 2',
    ]


def test_histogram_buckets_are_cumulative_with_inf_sum_and_count():
    hist = Histogram("x_seconds", "Latency.", buckets=(0.1, 1.0))
    for value in (0.05, 0.5, 5.0):
        hist.observe(value)
    assert render([hist]).splitlines()[2:] == [
        'x_seconds_bucket{le="0.1"} 1',
        'x_seconds_bucket{le="1"} 2',
        'x_seconds_bucket{le="+Inf"} 3',
        "x_seconds_sum 5.55",
        "x_seconds_count 3",
    ]


def test_label_values_are_escaped():
    gauge = Gauge("x_up", "Up.")
    gauge.set(1, node='a"b\\c\nd')
    assert render([gauge]).splitlines()[-1] == 'x_up{node="a\\"b\\\\c\\nd"} 1'


def test_router_metrics_record_a_finished_request_in_every_histogram():
    marks = TimingMarks(arrival=0.0, dispatched=0.001)
    marks.merge_node_timing({"prefill_queue": 0.01, "prefill_compute": 0.02, "kv_transfer": 0.003})
    for t in (0.05, 0.06, 0.08):
        marks.tokens_arrived(t)
    marks.finished = 0.08
    metrics = RouterMetrics()
    metrics.request_done(200, assemble(marks, 0.08), completion_tokens=3)
    metrics.request_done(400, None, 0)
    text = metrics.render()
    assert 'pdserve_router_requests_total{status="200"} 1' in text
    assert 'pdserve_router_requests_total{status="400"} 1' in text
    assert "pdserve_router_generation_tokens_total 3" in text
    assert "pdserve_router_time_to_first_token_seconds_count 1" in text
    assert "pdserve_router_inter_token_latency_seconds_count 2" in text
    assert 'pdserve_router_phase_seconds_count{phase="kv_transfer"} 1' in text
    assert 'pdserve_router_phase_seconds_count{phase="first_token_delivery"} 1' in text


def test_every_line_is_a_comment_or_a_valid_sample():
    metrics = RouterMetrics()
    metrics.node_healthy.set(1, node="tcp://127.0.0.1:5601", role="prefill")
    metrics.ttft.observe(0.2)
    text = metrics.render()
    assert text.endswith("\n")
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or SAMPLE.match(line), line
