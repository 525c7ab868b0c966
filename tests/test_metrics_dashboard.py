"""The router's /metrics against vLLM's names and the Grafana dashboard: a real PD stack serves
a request, its exposition parses with prometheus_client's parser, the series vLLM has keep
vLLM's types, and every metric deploy/grafana/pdserve.json queries exists. The goodput grid,
the zero-filled node counters and the node memory arithmetic are checked without a stack."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.stack import ROOT
from router.metrics import (
    GOODPUT_TPOT_S,
    GOODPUT_TTFT_S,
    NodeCollector,
    RouterMetrics,
    node_memory_bytes,
)
from router.timing import TimingMarks, assemble
from tests.router_fakes import metric
from tests.test_several_stacks import start_side_by_side

DASHBOARD = ROOT / "deploy/grafana/pdserve.json"
# vLLM's name (after the prefix) -> its Prometheus type.
VLLM_TYPES = {
    "num_requests_running": "gauge",
    "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge",
    "cache_config_info": "gauge",
    "prefix_cache_queries": "counter",
    "prefix_cache_hits": "counter",
    "num_preemptions": "counter",
    "prompt_tokens": "counter",
    "generation_tokens": "counter",
    "request_success": "counter",
    "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram",
    "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram",
}


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """/metrics of a default PD stack (one prefill, one decode node) after two requests, once
    the decode node's heartbeat reports the KV it received."""
    (stack,) = start_side_by_side(tmp_path_factory.mktemp("pd"), [], 1)
    try:
        for text in ("Name a colour.", "Name a fruit."):
            stack.chat(text)

        def text_once_transferred() -> str | None:
            with urllib.request.urlopen(stack.url + "/metrics", timeout=30) as response:
                text = response.read().decode()
            return text if metric(text, "pdserve:kv_transfer_bytes_total", role="decode") else None

        yield stack.wait_for(text_once_transferred, "the decode node's KV bytes in /metrics")
    finally:
        assert stack.stop() == []


def dashboard_metrics() -> set[str]:
    board = json.loads(DASHBOARD.read_text())
    texts = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    texts += [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"]
    return {name for text in texts for name in re.findall(r"pdserve:[A-Za-z0-9_:]+", text)}


def test_the_exposition_parses_and_vllm_named_series_keep_vllm_types(scraped):
    families = {f.name: f for f in text_string_to_metric_families(scraped)}
    for name, kind in VLLM_TYPES.items():
        family = families.get("pdserve:" + name)
        assert family is not None and family.type == kind, name
        assert all(s.labels.get("model_name") for s in family.samples), name
    decode = next(s for s in families["pdserve:cache_config_info"].samples
                  if s.labels["role"] == "decode")  # fmt: skip
    assert int(decode.labels["num_gpu_blocks"]) > 0 and decode.labels["block_size"] == "16"


def test_every_metric_the_dashboard_queries_exists(scraped):
    names = {s.name for f in text_string_to_metric_families(scraped) for s in f.samples}
    queried = dashboard_metrics()
    assert len(queried) > 20
    assert sorted(queried - names) == []


def test_a_served_request_shows_in_goodput_memory_and_kv_transfer(scraped):
    ok = metric(scraped, "pdserve:requests_total", status="200")
    assert ok == 2
    loosest = metric(scraped, "pdserve:request_goodput_total", ttft_slo_s="5.0", tpot_slo_s="0.2")
    tightest = metric(scraped, "pdserve:request_goodput_total", ttft_slo_s="0.2", tpot_slo_s="0.02")
    assert 0 <= tightest <= loosest <= ok
    for kind in ("weights", "kv"):
        for role in ("prefill", "decode"):
            assert metric(scraped, "pdserve:node_memory_bytes", role=role, kind=kind) > 0
    assert metric(scraped, "pdserve:kv_transfer_bytes_total", role="decode") > 0
    assert metric(scraped, "pdserve:kv_transfer_failures_total", role="decode") == 0


def finished(ttft: float, end: float, tokens: int) -> tuple:
    marks = TimingMarks(arrival=0.0, dispatched=0.0)
    marks.tokens_arrived(ttft)
    marks.finished = end
    return assemble(marks, end), tokens


def test_goodput_counts_each_pair_of_objectives_a_request_meets():
    metrics = RouterMetrics("m")
    timing, tokens = finished(ttft=0.3, end=0.3 + 9 * 0.04, tokens=10)  # TPOT 0.04 s
    metrics.request_done(200, timing, tokens, ["stop"])
    metrics.request_done(500, *finished(0.1, 0.2, 2), [])  # a failure meets nothing
    text = metrics.render()
    for ttft in GOODPUT_TTFT_S:
        for tpot in GOODPUT_TPOT_S:
            want = 1.0 if ttft >= 0.3 and tpot >= 0.04 else 0.0
            got = metric(text, "pdserve:request_goodput_total", ttft_slo_s=str(ttft),
                         tpot_slo_s=str(tpot))  # fmt: skip
            assert got == want, (ttft, tpot)
    assert metric(text, "pdserve:request_time_per_output_token_seconds_sum") == pytest.approx(0.04)
    assert metric(text, "pdserve:request_decode_time_seconds_sum") == pytest.approx(0.36)
    assert metric(text, "pdserve:request_generation_tokens_count") == 1


def test_n_choices_divide_the_tokens_and_a_one_token_answer_meets_any_tpot():
    metrics = RouterMetrics("m")
    metrics.request_done(200, *finished(0.1, 0.1 + 4 * 0.05, 10), ["stop", "stop"])  # 5 each
    metrics.request_done(200, *finished(0.1, 0.1, 1), ["length"])
    text = metrics.render()
    assert metric(text, "pdserve:request_time_per_output_token_seconds_sum") == pytest.approx(0.05)
    assert metric(text, "pdserve:request_time_per_output_token_seconds_count") == 1
    tight = metric(text, "pdserve:request_goodput_total", ttft_slo_s="0.2", tpot_slo_s="0.02")
    assert tight == 1  # the one-token answer


def test_node_counters_are_zero_until_they_move_and_memory_comes_from_the_info():
    kv_format = {"kv_dtype": "float8_e4m3fn", "num_layers": 2, "planes": 1, "num_kv_heads": 1,
                 "head_dim": 576}  # fmt: skip
    info = {"num_kv_blocks": 9, "block_size": 16, "weight_bytes": 1000, "cuda_graph_bytes": 7,
            "prefill_graph_bytes": 3, "kv_format": kv_format, "tp": 4}  # fmt: skip
    # A latent (MLA) pool is one head on every rank.
    assert node_memory_bytes(info) == {"weights": 1000, "graphs": 10, "kv": 10 * 16 * 2 * 576}
    assert node_memory_bytes({}) == {}
    metrics = RouterMetrics("m")
    metrics.add_collector(NodeCollector("m", lambda: [("tcp://d", "decode", True, info, {})]))
    text = metrics.render()
    assert metric(text, "pdserve:kv_transfer_failures_total", node="tcp://d") == 0
    assert metric(text, "pdserve:node_memory_bytes", node="tcp://d", kind="kv") == 10 * 16 * 1152
    info_sample = metric(text, "pdserve:cache_config_info", node="tcp://d", num_gpu_blocks="9",
                         cache_dtype="float8_e4m3fn", block_size="16")  # fmt: skip
    assert info_sample == 1
