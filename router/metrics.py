"""A small Prometheus text-format (0.0.4) implementation and the router's own metrics."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from router.timing import TimingRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip

Labels = tuple[tuple[str, str], ...]


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    return "{" + body + "}" if body else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str) -> None:
        self.name = name
        self.help = help_text

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str) -> None:
        super().__init__(name, help_text)
        self.values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def render(self) -> list[str]:
        return self.header() + [
            f"{self.name}{_labels(k)} {_number(v)}" for k, v in sorted(self.values.items())
        ]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] = value


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float] = LATENCY_BUCKETS):
        super().__init__(name, help_text)
        if list(buckets) != sorted(buckets):
            raise ValueError(f"histogram buckets must ascend, got {buckets}")
        self.buckets = tuple(buckets)
        self.series: dict[Labels, tuple[list[int], list[float]]] = {}  # counts, [sum, count]

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        counts, totals = self.series.setdefault(key, ([0] * len(self.buckets), [0.0, 0.0]))
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                counts[i] += 1
        totals[0] += value
        totals[1] += 1

    def render(self) -> list[str]:
        lines = self.header()
        for key, (counts, (total, count)) in sorted(self.series.items()):
            for bound, n in zip(self.buckets, counts, strict=True):
                lines.append(f"{self.name}_bucket{_labels((*key, ('le', _number(bound))))} {n}")
            lines.append(f"{self.name}_bucket{_labels((*key, ('le', '+Inf')))} {_number(count)}")
            lines.append(f"{self.name}_sum{_labels(key)} {_number(total)}")
            lines.append(f"{self.name}_count{_labels(key)} {_number(count)}")
        return lines


def render(metrics: Iterable[_Metric]) -> str:
    return "\n".join(line for m in metrics for line in m.render()) + "\n"


class RouterMetrics:
    """Requests by final status, token counts, and latency histograms from timing records."""

    def __init__(self, prefix: str = "pdserve_router") -> None:
        p = prefix
        self.requests = Counter(
            f"{p}_requests_total", "Finished requests by HTTP status (499: client gone)."
        )
        self.prompt_tokens = Counter(
            f"{p}_prompt_tokens_total", "Prompt tokens of dispatched requests."
        )
        self.generation_tokens = Counter(
            f"{p}_generation_tokens_total", "Tokens returned to clients."
        )
        self.node_requests = Counter(
            f"{p}_node_requests_total", "Requests dispatched to each node, by node and role."
        )
        self.running = Gauge(f"{p}_requests_running", "Requests dispatched and not finished.")
        self.node_healthy = Gauge(f"{p}_node_healthy", "1 if the node heartbeats in time.")
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "Arrival to first token.")
        self.itl = Histogram(f"{p}_inter_token_latency_seconds", "Gaps between token arrivals.")
        self.e2e = Histogram(f"{p}_e2e_request_latency_seconds", "Arrival to finish.")
        self.phase = Histogram(f"{p}_phase_seconds", "Each phase of the timing record.")
        self.running.set(0)

    def all(self) -> list[_Metric]:
        return [self.requests, self.prompt_tokens, self.generation_tokens, self.node_requests,
                self.running, self.node_healthy, self.ttft, self.itl, self.e2e, self.phase]  # fmt: skip

    def request_done(
        self, status: int, timing: TimingRecord | None, completion_tokens: int
    ) -> None:
        self.requests.inc(status=str(status))
        self.generation_tokens.inc(completion_tokens)
        if timing is None:
            return
        if timing.ttft is not None:
            self.ttft.observe(timing.ttft)
        for gap in timing.gaps:
            self.itl.observe(gap)
        self.e2e.observe(timing.e2e)
        for name, value in timing.phases().items():
            self.phase.observe(value, phase=name)

    def render(self) -> str:
        return render(self.all())
