"""Latency objectives (`SLO`) and the percentile the benchmark and the planner both report.

Definitions follow `vllm bench serve`: TTFT, TPOT = (E2E - TTFT) / (output tokens - 1), E2E
latency; a request meets the SLO when it completed within every objective given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

SLO_KEYS = ("ttft", "tpot", "e2el")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class TimedRequest(Protocol):
    """What `SLO` reads of a finished request (the benchmark's `RequestResult`), in seconds."""

    @property
    def success(self) -> bool: ...
    @property
    def ttft(self) -> float | None: ...
    @property
    def tpot(self) -> float | None: ...
    @property
    def e2e(self) -> float | None: ...


@dataclass(frozen=True)
class SLO:
    """Latency objectives in milliseconds; None = not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, items: Sequence[str]) -> SLO:
        """From `ttft:MS tpot:MS e2el:MS` (any subset), as `vllm bench serve --goodput`."""
        values: dict[str, float] = {}
        for item in items:
            key, sep, value = item.partition(":")
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"bad SLO {item!r}: use ttft:MS, tpot:MS or e2el:MS")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"bad SLO {item!r}: {value!r} is not a number") from None
            if not ms > 0:
                raise ValueError(f"bad SLO {item!r}: the objective must be > 0 ms")
            values[f"{key}_ms"] = ms
        return cls(**values)

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def to_dict(self) -> dict[str, float]:
        return {k: v for k, v in vars(self).items() if v is not None}

    def ttft_missed(self, ttft_s: float) -> bool:
        return self.ttft_ms is not None and ttft_s * 1000 > self.ttft_ms

    def met(self, r: TimedRequest) -> bool:
        """A completed request within every objective (a TPOT of None, one token, is met)."""
        return r.success and self.met_times(r.ttft, r.tpot, r.e2e)

    def met_times(self, ttft: float | None, tpot: float | None, e2e: float | None) -> bool:
        """Seconds within every objective; no TTFT or E2E (never finished) is a miss."""
        if ttft is None or e2e is None or self.ttft_missed(ttft):
            return False
        if self.tpot_ms is not None and tpot is not None and tpot * 1000 > self.tpot_ms:
            return False
        return self.e2el_ms is None or e2e * 1000 <= self.e2el_ms

    def misses(self, completed: Iterable[TimedRequest]) -> dict[str, int]:
        """How many completed requests missed each objective (one request may miss several)."""
        out = {"ttft": 0, "tpot": 0, "e2el": 0}
        for r in completed:
            out["ttft"] += _over(r.ttft, self.ttft_ms)
            out["tpot"] += _over(r.tpot, self.tpot_ms)
            out["e2el"] += _over(r.e2e, self.e2el_ms)
        return out


def _over(value: float | None, objective_ms: float | None) -> bool:
    return objective_ms is not None and value is not None and value * 1000 > objective_ms
