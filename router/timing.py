"""Per-request timing record: router-side marks plus the durations the nodes measured.

Every duration is measured inside one process on its own monotonic clock; the router never
subtracts timestamps taken by different processes. In both modes the record satisfies
    ttft = router_queue_tokenize + router_encode + node_decode + prefill_queue
           + prefill_compute + first_token_delivery
Every phase but the last is measured where it happens: the router's validation, tokenization
and routing; its encoding and hand-off of the messages to the sockets; the node's parsing of
its request message; the prefill queue and compute. first_token_delivery is what the router
saw between handing the messages off and receiving the first token, less the node's measured
phases: only socket transit and the router's event loop are left in it. The benchmarks check
the sum against the client's own clock, which also holds HTTP and SSE time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.engine.spec_decode.stats import SpecStats

NODE_PHASES = (
    "node_decode",
    "prefill_queue",
    "prefill_compute",
    "kv_transfer",
    "decode_admission_wait",
)
TTFT_PHASES = (
    "router_queue_tokenize",
    "router_encode",
    "node_decode",
    "prefill_queue",
    "prefill_compute",
    "first_token_delivery",
)


@dataclass
class TimingMarks:
    """Router-clock timestamps of one request, plus the durations nodes reported."""

    arrival: float
    dispatched: float | None = None  # routing done, messages about to be encoded
    sent: float | None = None  # messages encoded and handed to the sockets
    first_token: float | None = None
    finished: float | None = None
    # Per choice (n > 1 has several): one arrival per event that carried tokens of it. Gaps are
    # taken within a choice; one decode step brings a row of every choice at the same moment.
    token_arrivals: dict[int, list[float]] = field(default_factory=dict)
    node_timing: dict[str, float] = field(default_factory=dict)
    # Speculative decoding counts of the samples the decode node finished (None: none came)
    spec_decode: SpecStats | None = None

    def tokens_arrived(self, now: float, index: int = 0) -> None:
        if self.first_token is None:
            self.first_token = now
        self.token_arrivals.setdefault(index, []).append(now)

    def merge_node_timing(self, timing: dict[str, Any] | None) -> None:
        for key, value in (timing or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.node_timing[key] = float(value)

    def add_spec_decode(self, counts: dict[str, Any]) -> None:
        """One sample's counts, as a finishing `TokenOutput` carried them (validated there)."""
        stats = SpecStats(
            counts["num_drafts"],
            counts["num_draft_tokens"],
            counts["num_accepted_tokens"],
            list(counts["accepted_per_position"]),
        )
        if self.spec_decode is None:
            self.spec_decode = SpecStats()
        self.spec_decode.add(stats)


@dataclass(frozen=True)
class IntervalSummary:
    count: int = 0
    mean: float | None = None
    p50: float | None = None
    p99: float | None = None
    max: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "mean": self.mean,
            "p50": self.p50,
            "p99": self.p99,
            "max": self.max,
        }


@dataclass(frozen=True)
class TimingRecord:
    router_queue_tokenize: float | None
    router_encode: float | None
    node_decode: float | None
    prefill_queue: float | None
    prefill_compute: float | None
    kv_transfer: float | None
    decode_admission_wait: float | None
    first_token_delivery: float | None
    ttft: float | None
    e2e: float
    decode_intervals: IntervalSummary
    gaps: tuple[float, ...] = ()  # the raw decode intervals, for the metrics histogram
    extra: dict[str, float] = field(default_factory=dict)  # other node-reported durations
    spec_decode: SpecStats | None = None  # the samples' speculative decoding counts, summed

    def phases(self) -> dict[str, float]:
        """Every measured scalar phase, for histograms."""
        names = ("router_queue_tokenize", "router_encode", *NODE_PHASES, "first_token_delivery")
        known = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        return {**known, **self.extra}

    def to_dict(self) -> dict[str, Any]:
        """The `timing` extension field of a response (seconds; null = not measured)."""
        out: dict[str, Any] = {
            "router_queue_tokenize": self.router_queue_tokenize,
            "router_encode": self.router_encode,
            "node_decode": self.node_decode,
            "prefill_queue": self.prefill_queue,
            "prefill_compute": self.prefill_compute,
            "kv_transfer": self.kv_transfer,
            "decode_admission_wait": self.decode_admission_wait,
            "first_token_delivery": self.first_token_delivery,
            "ttft": self.ttft,
            "e2e": self.e2e,
        }
        out.update(self.extra)
        out["decode_intervals"] = self.decode_intervals.to_dict()
        if self.spec_decode is not None:
            out["spec_decode"] = self.spec_decode.to_dict()
        return out


def assemble(marks: TimingMarks, now: float) -> TimingRecord:
    """The record as of `now` (the finish time once the request has finished)."""
    node = marks.node_timing
    queue = None if marks.dispatched is None else marks.dispatched - marks.arrival
    encode = None
    if marks.sent is not None and marks.dispatched is not None:
        encode = marks.sent - marks.dispatched
    ttft = None if marks.first_token is None else marks.first_token - marks.arrival
    delivery = None
    handed_off = marks.sent if marks.sent is not None else marks.dispatched
    if marks.first_token is not None and handed_off is not None:
        delivery = marks.first_token - handed_off
        delivery -= sum(
            node.get(p, 0.0) for p in ("node_decode", "prefill_queue", "prefill_compute")
        )
    end = marks.finished if marks.finished is not None else now
    gaps = tuple(
        b - a
        for arrivals in marks.token_arrivals.values()
        for a, b in zip(arrivals[:-1], arrivals[1:], strict=True)
    )
    return TimingRecord(
        router_queue_tokenize=queue,
        router_encode=encode,
        node_decode=node.get("node_decode"),
        prefill_queue=node.get("prefill_queue"),
        prefill_compute=node.get("prefill_compute"),
        kv_transfer=node.get("kv_transfer"),
        decode_admission_wait=node.get("decode_admission_wait"),
        first_token_delivery=delivery,
        ttft=ttft,
        e2e=end - marks.arrival,
        decode_intervals=summarize(gaps),
        gaps=gaps,
        extra={k: v for k, v in node.items() if k not in NODE_PHASES},
        spec_decode=marks.spec_decode,
    )


def summarize(values: tuple[float, ...] | list[float]) -> IntervalSummary:
    if not values:
        return IntervalSummary()
    ordered = sorted(values)
    return IntervalSummary(
        count=len(ordered),
        mean=sum(ordered) / len(ordered),
        p50=percentile(ordered, 50.0),
        p99=percentile(ordered, 99.0),
        max=ordered[-1],
    )


def percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty list."""
    if not ordered:
        raise ValueError("percentile of an empty list")
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100), at least 1
    return ordered[min(len(ordered), int(rank)) - 1]
