"""Step-time models fitted to the profiler's raw points. Pure Python.

Prefill: piecewise-linear in the step's tokens through the measured whole-prompt steps (each
already holds its own attention, T*T/2 query-key pairs), plus an attention term for the pairs
beyond that reference: a chunk of n tokens after p cached ones has n*p + n*n/2 pairs, so later
chunks of a long prompt cost more than its first. Decode: a + b*batch + c*sum(context), plus
for a mixture-of-experts model d * the bytes of the experts the step's tokens touch (`ExpertLoad`:
under uniform routing a batch of 1 reads top_k experts per layer, a large batch all of them, so
the step time is concave in the batch, not linear). A colocated step that mixes prefill chunks and decodes is a prefill step over all its tokens
(decodes count one token and `context` pairs each), never cheaper than its decodes alone.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


class _Prefill(Protocol):
    tokens: int
    context: int
    seconds: float


class _Decode(Protocol):
    batch: int
    context: int
    seconds: float


def attention_pairs(tokens: int, context: int) -> float:
    """Query-key pairs of `tokens` new tokens after `context` cached ones (causal)."""
    return tokens * context + tokens * tokens / 2


@dataclass(frozen=True)
class PrefillFit:
    knot_tokens: tuple[int, ...]  # whole-prompt step sizes, ascending
    knot_seconds: tuple[float, ...]  # their step times (non-decreasing)
    seconds_per_pair: float = 0.0  # attention beyond the reference T*T/2 pairs

    def __post_init__(self) -> None:
        if not self.knot_tokens or len(self.knot_tokens) != len(self.knot_seconds):
            raise ValueError(
                f"need matching non-empty knots, got {self.knot_tokens} and {self.knot_seconds}"
            )

    def base(self, tokens: float) -> float:
        """Piecewise-linear through the knots; flat below the first, last slope past the end."""
        xs, ys = self.knot_tokens, self.knot_seconds
        if tokens <= xs[0]:
            return ys[0]
        i = bisect.bisect_right(xs, tokens)
        if i == len(xs):
            if len(xs) == 1:
                return ys[0] * tokens / xs[0]
            i -= 1
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def time(self, tokens: float, pairs: float | None = None) -> float:
        """A step of `tokens` tokens with `pairs` attention pairs (default: one new prompt)."""
        extra = 0.0 if pairs is None else pairs - tokens * tokens / 2
        base = self.base(tokens)
        return max(0.5 * base, base + self.seconds_per_pair * extra)


def expected_touched(num_experts: int, top_k: int, tokens: float) -> float:
    """Distinct experts `tokens` tokens route to, in expectation, when each token picks `top_k`
    of `num_experts` uniformly: a token misses a given expert with probability 1 - k/E, all of
    them with (1 - k/E)^tokens, so E * (1 - (1 - k/E)^tokens) are touched."""
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in 1..num_experts {num_experts}")
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class ExpertLoad:
    """The routed experts of one rank of an MoE model, as a decode step reads them: the rank
    holds `local_experts` of the `num_experts` (all of them under tensor parallelism, 1/size
    under expert parallelism), each `bytes_per_expert` summed over the MoE layers (its gate_up
    and down, this rank's slice). Each expert is touched with the same probability, so the
    rank reads local_experts / num_experts of the expected touched experts."""

    num_experts: int
    top_k: int
    local_experts: int
    bytes_per_expert: int

    def __post_init__(self) -> None:
        expected_touched(self.num_experts, self.top_k, 1)  # validates top_k
        if not 0 < self.local_experts <= self.num_experts or self.bytes_per_expert <= 0:
            raise ValueError(
                f"{self.local_experts} local experts of {self.num_experts}, "
                f"{self.bytes_per_expert} bytes each: not an expert load"
            )

    def touched_bytes(self, batch: float) -> float:
        share = self.local_experts / self.num_experts
        return share * expected_touched(self.num_experts, self.top_k, batch) * self.bytes_per_expert


@dataclass(frozen=True)
class DecodeFit:
    base: float
    per_seq: float
    per_context_token: float
    per_expert_byte: float = 0.0  # seconds per touched expert byte (MoE models only)
    experts: ExpertLoad | None = None

    def time(self, batch: int, context_sum: float) -> float:
        t = self.base + self.per_seq * batch + self.per_context_token * context_sum
        if self.experts is not None:
            t += self.per_expert_byte * self.experts.touched_bytes(batch)
        return t

    def steps_time(self, batch: int, context_sum: float, steps: int) -> float:
        """`steps` consecutive steps of the same batch, every context one longer each step."""
        growth = self.per_context_token * batch * steps * (steps - 1) / 2
        return steps * self.time(batch, context_sum) + growth


@dataclass(frozen=True)
class CostModel:
    prefill: PrefillFit
    decode: DecodeFit

    def step_time(
        self, prefill_tokens: int, prefill_pairs: float, decodes: int, context_sum: float
    ) -> float:
        """One engine step: prefill chunks (`prefill_pairs` pairs in all) and `decodes` decode
        rows over `context_sum` cached tokens."""
        decode = self.decode.time(decodes, context_sum) if decodes else 0.0
        if not prefill_tokens:
            return decode
        mixed = self.prefill.time(prefill_tokens + decodes, prefill_pairs + context_sum)
        return max(mixed, decode)


def fit_prefill(points: Iterable[_Prefill]) -> PrefillFit:
    points = list(points)
    whole: dict[int, list[float]] = {}
    for p in points:
        if p.context == 0:
            whole.setdefault(p.tokens, []).append(p.seconds)
    if not whole:
        raise ValueError("no whole-prompt prefill points (context 0) to fit")
    xs = sorted(whole)
    ys, top = [], 0.0
    for x in xs:  # more tokens never take less time: a running maximum evens out noise
        top = max(top, sum(whole[x]) / len(whole[x]))
        ys.append(top)
    fit = PrefillFit(tuple(xs), tuple(ys))
    # One coefficient for the extra attention of chunks after a context, least squares
    # through the origin over the residuals of the piecewise-linear part.
    rows = [
        (
            attention_pairs(p.tokens, p.context) - p.tokens * p.tokens / 2,
            p.seconds - fit.base(p.tokens),
        )
        for p in points
        if p.context > 0
    ]
    sxx = sum(x * x for x, _ in rows)
    slope = max(0.0, sum(x * y for x, y in rows) / sxx) if sxx > 0 else 0.0
    return PrefillFit(tuple(xs), tuple(ys), slope)


def fit_decode(points: Iterable[_Decode], experts: ExpertLoad | None = None) -> DecodeFit:
    """Least squares of seconds = a + b*batch + c*batch*context (+ d*touched expert bytes at
    batch, with `experts`), coefficients kept >= 0 (a negative one is dropped and the rest
    refitted)."""
    points = list(points)
    if not points:
        raise ValueError("no decode points to fit")
    rows = [
        (1.0, float(p.batch), float(p.batch * p.context))
        + ((experts.touched_bytes(p.batch),) if experts is not None else ())
        for p in points
    ]
    ys = [p.seconds for p in points]
    active = list(range(len(rows[0])))
    while True:
        coef = _least_squares([[r[i] for i in active] for r in rows], ys)
        if coef is not None and all(c >= 0 for c in coef):
            break
        drop = active[-1] if coef is None else active[min(range(len(coef)), key=coef.__getitem__)]
        active.remove(drop)
        if not active:
            coef = []
            break
    full = [0.0, 0.0, 0.0, 0.0]
    for i, c in zip(active, coef, strict=True):
        full[i] = c
    return DecodeFit(*full, experts=experts)


def _least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float] | None:
    """Solve the normal equations (Gaussian elimination) on columns scaled to a largest entry
    of 1 (touched expert bytes reach 1e11 where the constant column is 1: unscaled, the
    singularity test would drop it); None when they are singular."""
    scales = [max(abs(r[i]) for r in rows) or 1.0 for i in range(len(rows[0]))]
    rows = [[x / s for x, s in zip(r, scales, strict=True)] for r in rows]
    coef = _solve_normal(rows, ys)
    return None if coef is None else [c / s for c, s in zip(coef, scales, strict=True)]


def _solve_normal(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float] | None:
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(n)]
    scale = max(abs(a[i][i]) for i in range(n)) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] for i in range(n)]


def fit(
    prefill: Iterable[_Prefill], decode: Iterable[_Decode], experts: ExpertLoad | None = None
) -> CostModel:
    return CostModel(fit_prefill(prefill), fit_decode(decode, experts))


def max_relative_error(
    model: CostModel, prefill: Iterable[_Prefill], decode: Iterable[_Decode]
) -> float:
    """The largest |predicted - measured| / measured over the raw points (how well it fits)."""
    errors = [
        abs(model.prefill.time(p.tokens, attention_pairs(p.tokens, p.context)) - p.seconds)
        / p.seconds
        for p in prefill
    ]
    errors += [
        abs(model.decode.time(p.batch, p.batch * p.context) - p.seconds) / p.seconds for p in decode
    ]
    return max(errors, default=0.0)
