"""The router's Prometheus metrics (prometheus_client), named after vLLM's.

A metric vLLM has keeps vLLM's name after the prefix (`vllm:X` is `pdserve:X`), its type, its
`model_name` label and its other labels (`finished_reason`); one prefix only, so that no
series is exported twice (a Prometheus relabel rule renames them for a vLLM dashboard: README).
Two sources:
- what the router observes itself (`RouterMetrics`): requests and tokens, latency histograms
  from each request's timing record, the TTFT phases, goodput against a grid of latency
  objectives, admission queues, dispatches per node, speculative decoding's drafted and
  accepted tokens (vLLM's `spec_decode` family; counted when a request closes, from the
  counts its finishing rows carried);
- what each node reported in its last heartbeat (`NodeCollector`, read at scrape time):
  running / waiting requests, KV cache usage and size, memory, prefix cache queries and hits,
  KV transfer bytes, seconds and failures, preemptions, dropped frames, with `node` and `role`
  labels. Sum over `node` for the pool or cluster figure vLLM's dashboards expect. A node's
  counters restart from 0 with the node, which Prometheus' rate() handles as a counter reset.
The README maps each name to its vLLM counterpart; deploy/grafana/pdserve.json plots them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.timing import TimingRecord

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
TOKEN_BUCKETS = (
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000,
)  # fmt: skip
# Goodput's grid of objectives (seconds): a request meets (ttft, tpot) when it succeeded, its
# TTFT is at most ttft and its time per output token (decode time over the tokens after the
# first, the `vllm bench serve --goodput` definition) at most tpot. A dashboard picks a pair.
GOODPUT_TTFT_S = (0.2, 0.5, 1.0, 2.0, 5.0)
GOODPUT_TPOT_S = (0.02, 0.05, 0.1, 0.2)
# Bytes per element of a KV pool's dtype, as heartbeats name it.
KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}

# Heartbeat load key -> (metric name, help). Gauges are the node's state now, counters count
# since the node started.
NODE_GAUGES = {
    "running": ("pdserve:num_requests_running", "Requests running on the node."),
    "waiting": ("pdserve:num_requests_waiting", "Requests waiting on the node."),
    "used_blocks": ("pdserve:kv_cache_used_blocks", "KV blocks in use on the node."),
}
NODE_COUNTERS = {
    "prefix_cache_queries": ("pdserve:prefix_cache_queries", "Prompt tokens looked up."),
    "prefix_cache_hits": ("pdserve:prefix_cache_hits", "Prompt tokens found in the cache."),
    "kv_transfer_bytes": ("pdserve:kv_transfer_bytes", "KV bytes received (decode nodes)."),
    "kv_transfer_seconds": ("pdserve:kv_transfer_seconds", "Seconds KV transfers took."),
    "kv_transfer_failures": ("pdserve:kv_transfer_failures", "KV transfers that failed."),
    "kv_late_frames": ("pdserve:kv_late_frames", "KV frames dropped: no live reservation."),
    "kv_malformed_frames": ("pdserve:kv_malformed_frames", "KV frames dropped as malformed."),
    "preemptions": ("pdserve:num_preemptions", "Sequences preempted for KV memory."),
    "invalid_messages": ("pdserve:invalid_messages", "Control frames rejected as invalid."),
    "undelivered_messages": (
        "pdserve:undelivered_messages",
        "Control messages to a peer node dropped because its queue was full.",
    ),
    "expired_requests": ("pdserve:expired_requests", "Requests dropped at their deadline."),
}


class RouterMetrics:
    def __init__(self, model_name: str = "pdserve") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        m, reg = ["model_name"], self.registry
        self.requests = Counter(
            "pdserve:requests", "Finished requests by HTTP status (499: client gone).",
            [*m, "status"], registry=reg,
        )  # fmt: skip
        self.success = Counter(
            "pdserve:request_success", "Finished choices of 200 responses, by finish reason.",
            [*m, "finished_reason"], registry=reg,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "pdserve:prompt_tokens", "Prompt tokens of dispatched requests.", m, registry=reg
        )
        self.generation_tokens = Counter(
            "pdserve:generation_tokens", "Tokens returned to clients.", m, registry=reg
        )
        self.node_requests = Counter(
            "pdserve:node_requests", "Requests dispatched to each node.",
            [*m, "node", "role"], registry=reg,
        )  # fmt: skip
        self.in_flight = Gauge(
            "pdserve:router_requests_in_flight", "Requests dispatched and not finished.", m,
            registry=reg,
        )  # fmt: skip
        self.waiting = Gauge(
            "pdserve:router_requests_waiting", "Requests waiting for a pool (admission).",
            [*m, "pool"], registry=reg,
        )  # fmt: skip

        def hist(name: str, text: str, labels: Iterable[str] = ()) -> Histogram:
            return Histogram(name, text, [*m, *labels], buckets=LATENCY_BUCKETS, registry=reg)

        self.ttft = hist("pdserve:time_to_first_token_seconds", "Arrival to first token.")
        self.itl = hist(
            "pdserve:inter_token_latency_seconds", "Gaps between token arrivals of a choice."
        )
        self.e2e = hist("pdserve:e2e_request_latency_seconds", "Arrival to finish.")
        self.decode_time = hist(
            "pdserve:request_decode_time_seconds", "First token to finish (200 responses)."
        )
        self.tpot = hist(
            "pdserve:request_time_per_output_token_seconds",
            "Per request: decode time over the tokens after each choice's first.",
        )
        self.request_prompt_tokens = Histogram(
            "pdserve:request_prompt_tokens", "Prompt tokens of each dispatched request.", m,
            buckets=TOKEN_BUCKETS, registry=reg,
        )  # fmt: skip
        self.request_generation_tokens = Histogram(
            "pdserve:request_generation_tokens", "Tokens returned by each 200 response.", m,
            buckets=TOKEN_BUCKETS, registry=reg,
        )  # fmt: skip
        self.goodput = Counter(
            "pdserve:request_goodput",
            "200 responses within both objectives: TTFT <= ttft_slo_s and time per output "
            "token <= tpot_slo_s (rate() of it is goodput).",
            [*m, "ttft_slo_s", "tpot_slo_s"], registry=reg,
        )  # fmt: skip
        for ttft in GOODPUT_TTFT_S:  # every pair exists from the start, at 0
            for tpot in GOODPUT_TPOT_S:
                self.goodput.labels(model_name, str(ttft), str(tpot))
        self.queue_time = hist("pdserve:request_queue_time_seconds", "Prefill queue time.")
        self.prefill_time = hist("pdserve:request_prefill_time_seconds", "Prefill compute.")
        self.phase = hist(
            "pdserve:request_phase_seconds", "Each phase of the timing record.", ["phase"]
        )
        self.spec_drafts = Counter(
            "pdserve:spec_decode_num_drafts", "Verify steps of a sequence with drafted tokens.",
            m, registry=reg,
        )  # fmt: skip
        self.spec_draft_tokens = Counter(
            "pdserve:spec_decode_num_draft_tokens", "Drafted tokens.", m, registry=reg
        )
        self.spec_accepted_tokens = Counter(
            "pdserve:spec_decode_num_accepted_tokens", "Drafted tokens accepted.", m, registry=reg
        )
        self.spec_accepted_per_pos = Counter(
            "pdserve:spec_decode_num_accepted_tokens_per_pos",
            "Drafted tokens accepted at each draft position (0-based).",
            [*m, "position"], registry=reg,
        )  # fmt: skip
        self.in_flight.labels(model_name).set(0)

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def dispatched(self, prompt_tokens: int, nodes: Iterable[tuple[str, str]]) -> None:
        self.in_flight.labels(self.model_name).inc()
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self.request_prompt_tokens.labels(self.model_name).observe(prompt_tokens)
        for node_id, role in nodes:
            self.node_requests.labels(self.model_name, node_id, role).inc()

    def released(self) -> None:
        self.in_flight.labels(self.model_name).dec()

    def request_done(
        self,
        status: int,
        timing: TimingRecord | None,
        completion_tokens: int,
        finish_reasons: Iterable[str] = (),
    ) -> None:
        """`finish_reasons`: one per choice that finished (n > 1 requests have several)."""
        name, reasons = self.model_name, list(finish_reasons)
        self.requests.labels(name, str(status)).inc()
        self.generation_tokens.labels(name).inc(completion_tokens)
        if status == 200:
            for reason in reasons:
                self.success.labels(name, reason).inc()
        if timing is None:
            return
        if timing.ttft is not None:
            self.ttft.labels(name).observe(timing.ttft)
        itl = self.itl.labels(name)
        for gap in timing.gaps:
            itl.observe(gap)
        self.e2e.labels(name).observe(timing.e2e)
        if timing.prefill_queue is not None:
            self.queue_time.labels(name).observe(timing.prefill_queue)
        if timing.prefill_compute is not None:
            self.prefill_time.labels(name).observe(timing.prefill_compute)
        for phase, value in timing.phases().items():
            self.phase.labels(name, phase).observe(value)
        if status == 200:
            self._succeeded(timing, completion_tokens, len(reasons))
        if timing.spec_decode is not None:
            spec = timing.spec_decode
            self.spec_drafts.labels(name).inc(spec.num_drafts)
            self.spec_draft_tokens.labels(name).inc(spec.num_draft_tokens)
            self.spec_accepted_tokens.labels(name).inc(spec.num_accepted_tokens)
            for position, count in enumerate(spec.accepted_per_position):
                self.spec_accepted_per_pos.labels(name, str(position)).inc(count)

    def _succeeded(self, timing: TimingRecord, completion_tokens: int, choices: int) -> None:
        """The per-request series vLLM keeps for finished requests, and goodput."""
        name = self.model_name
        self.request_generation_tokens.labels(name).observe(completion_tokens)
        if timing.ttft is None:
            return
        decode = max(0.0, timing.e2e - timing.ttft)
        self.decode_time.labels(name).observe(decode)
        after_first = completion_tokens / max(1, choices) - 1
        tpot = decode / after_first if after_first > 0 else 0.0
        if after_first > 0:
            self.tpot.labels(name).observe(tpot)
        for ttft_slo in GOODPUT_TTFT_S:
            for tpot_slo in GOODPUT_TPOT_S:
                if timing.ttft <= ttft_slo and tpot <= tpot_slo:
                    self.goodput.labels(name, str(ttft_slo), str(tpot_slo)).inc()

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class NodeCollector(Collector):
    """Per-node series from the nodes' last heartbeats, read at scrape time.

    `snapshot()` returns (node id, role, healthy, info, load) for every known node."""

    def __init__(
        self,
        model_name: str,
        snapshot: Callable[[], Iterable[tuple[str, str, bool, dict[str, Any], dict[str, Any]]]],
    ) -> None:
        self.model_name = model_name
        self.snapshot = snapshot

    def describe(self) -> list[Any]:
        return []  # unchecked: the families depend on which nodes exist at scrape time

    def collect(self) -> Iterable[Any]:
        labels = ["model_name", "node", "role"]
        healthy = GaugeMetricFamily(
            "pdserve:node_healthy", "1 if the node heartbeats in time.", labels=labels
        )
        usage = GaugeMetricFamily(
            "pdserve:kv_cache_usage_perc",
            "Fraction of the node's KV blocks in use (0-1).",
            labels=labels,
        )
        cache_info = GaugeMetricFamily(
            "pdserve:cache_config_info",
            "The node's KV pool (1): block size, cache dtype, number of blocks.",
            labels=[*labels, "block_size", "cache_dtype", "num_gpu_blocks"],
        )
        memory = GaugeMetricFamily(
            "pdserve:node_memory_bytes",
            "The node's memory by kind (weights, graphs, kv), per tensor-parallel rank.",
            labels=[*labels, "kind"],
        )
        gauges = {k: GaugeMetricFamily(n, h, labels=labels) for k, (n, h) in NODE_GAUGES.items()}
        counters = {
            k: CounterMetricFamily(n, h, labels=labels) for k, (n, h) in NODE_COUNTERS.items()
        }
        for node_id, role, up, info, load in self.snapshot():
            values = [self.model_name, node_id, role]
            healthy.add_metric(values, 1.0 if up else 0.0)
            total, used = _number(info.get("num_kv_blocks")), _number(load.get("used_blocks"))
            if total and used is not None:
                usage.add_metric(values, used / total)
            if total:
                kv_dtype = (info.get("kv_format") or {}).get("kv_dtype") or info.get("dtype")
                described = [str(info.get("block_size")), str(kv_dtype), str(int(total))]
                cache_info.add_metric([*values, *described], 1.0)
            for kind, nbytes in node_memory_bytes(info).items():
                memory.add_metric([*values, kind], float(nbytes))
            for key, family in gauges.items():
                value = _number(load.get(key))
                if value is not None:
                    family.add_metric(values, value)
            for key, family in counters.items():
                # A node reports a counter once it moved; 0 before that, so that rate() sees
                # its first increase.
                family.add_metric(values, _number(load.get(key)) or 0.0)
        yield healthy
        yield usage
        yield cache_info
        yield memory
        yield from gauges.values()
        yield from counters.values()


def node_memory_bytes(info: dict[str, Any]) -> dict[str, int]:
    """A node's memory by kind from its heartbeat info, per tensor-parallel rank: `weights`,
    `graphs` (decode and prefill CUDA graphs) and `kv` (its pool with the padding block; absent
    when the info lacks the pool's geometry). Nothing for a node that sent no info yet."""
    if not info:
        return {}
    out = {
        "weights": int(_number(info.get("weight_bytes")) or 0),
        "graphs": int(
            (_number(info.get("cuda_graph_bytes")) or 0)
            + (_number(info.get("prefill_graph_bytes")) or 0)
        ),
    }
    fmt = info.get("kv_format") or {}
    keys = ("num_layers", "planes", "num_kv_heads", "head_dim")
    sizes = [info.get("num_kv_blocks"), info.get("block_size"), *(fmt.get(k) for k in keys)]
    itemsize = KV_DTYPE_BYTES.get(fmt.get("kv_dtype"))
    if itemsize and all(isinstance(n, int) and n > 0 for n in sizes):
        blocks, block_size, layers, planes, heads, head_dim = sizes
        # The KVFormat counts every KV head; a rank holds its share (at least one: MLA's
        # latent and KV heads fewer than the ranks are replicated).
        heads = max(1, heads // int(info.get("tp") or 1))
        out["kv"] = (blocks + 1) * block_size * layers * planes * heads * head_dim * itemsize
    return out


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None
