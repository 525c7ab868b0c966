"""The router's Prometheus metrics (prometheus_client), named after vLLM's.

Every series has a `model_name` label. Two sources:
- what the router observes itself (`RouterMetrics`): requests and tokens, latency histograms
  from each request's timing record, the TTFT phases, admission queues, dispatches per node,
  speculative decoding's drafted and accepted tokens (vLLM's `spec_decode` family; counted
  when a request closes, from the counts its finishing rows carried);
- what each node reported in its last heartbeat (`NodeCollector`, read at scrape time):
  running / waiting requests, KV cache usage, prefix cache queries and hits, KV transfer
  bytes, seconds and failures, preemptions, dropped frames, with `node` and `role` labels.
  Sum over `node` for the pool or cluster figure vLLM's dashboards expect. A node's counters
  restart from 0 with the node, which Prometheus' rate() handles as a counter reset.
The README maps each name to its vLLM counterpart.
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
        name = self.model_name
        self.requests.labels(name, str(status)).inc()
        self.generation_tokens.labels(name).inc(completion_tokens)
        if status == 200:
            for reason in finish_reasons:
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
        if timing.spec_decode is not None:
            spec = timing.spec_decode
            self.spec_drafts.labels(name).inc(spec.num_drafts)
            self.spec_draft_tokens.labels(name).inc(spec.num_draft_tokens)
            self.spec_accepted_tokens.labels(name).inc(spec.num_accepted_tokens)
            for position, count in enumerate(spec.accepted_per_position):
                self.spec_accepted_per_pos.labels(name, str(position)).inc(count)

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
            for key, family in [*gauges.items(), *counters.items()]:
                value = _number(load.get(key))
                if value is not None:
                    family.add_metric(values, value)
        yield healthy
        yield usage
        yield from gauges.values()
        yield from counters.values()


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None
