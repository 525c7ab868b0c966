"""Benchmark-only proposers for `benchmarks/bench_spec.py`: they plug into `EngineCore.proposer`
like the real ones (`common.engine.spec_decode.proposer.Proposer`), so the step they feed is the
engine's own (scheduler, verify rows, `Sampler.verify`, rollback).

- `FixedDraftProposer` drafts exactly its limit every step: the cost of a verify step of K.
- `OracleProposer` drafts a reference greedy continuation (a run without speculation on the
  same prompts) for a run of `a` tokens, then a wrong one. `a` counts leading successes of
  probability `alpha` (at most the limit), as a real draft's acceptances run, with `alpha`
  solved so that the mean accepted length 1 + E[a] is the one asked for. Random weights give
  no real acceptance; this gives a controlled one.
- `TimedProposer` wraps any proposer and records the wall time of each `propose`.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from common.engine.scheduler import ScheduledBatch
from common.engine.spec_decode.proposer import Drafts, Proposer


def expected_run(alpha: float, k: int) -> float:
    """E[a]: leading successes of probability `alpha` among `k` tries."""
    return sum(alpha**j for j in range(1, k + 1))


def alpha_for_mean(mean_accepted_length: float, k: int) -> float:
    """The per-token acceptance whose runs of at most `k` give `mean_accepted_length`
    (1 + E[a]); ValueError outside [1, k + 1]."""
    target = mean_accepted_length - 1.0
    if not 0.0 <= target <= k:
        raise ValueError(
            f"mean accepted length {mean_accepted_length} is outside [1, {k + 1}] for K={k}"
        )
    lo, hi = 0.0, 1.0
    for _ in range(60):  # expected_run increases with alpha
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_run(mid, k) < target else (lo, mid)
    return 1.0 if target == k else (lo + hi) / 2


class FixedDraftProposer:
    """Drafts `limit` tokens for every item allowed to speculate: token (last + 1 + j) mod V,
    which a random model rejects, so every step verifies K + 1 rows and emits one token."""

    method = "fixed"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def propose(self, batch: ScheduledBatch, limits: list[int]) -> Drafts:
        drafts = []
        for item, k in zip(batch.items, limits, strict=True):
            last = item.seq.token_at(item.seq.num_tokens - 1)
            drafts.append([(last + 1 + j) % self.vocab_size for j in range(k)])
        return Drafts(drafts)

    def release(self, request_id: str) -> None:
        pass


class OracleProposer:
    """Drafts `references[request_id]` (that request's greedy output without speculation)
    from the sequence's output position: a run of `a` true tokens, then a wrong one (the true
    token + 1 mod V) for the rest of its limit. A sequence whose output has left its reference
    (bf16 rounding differs between a decode step and a verify step, and a random model's
    argmax is often a near tie) gets only wrong tokens; `off_track` names those requests."""

    method = "oracle"

    def __init__(
        self,
        references: dict[str, list[int]],
        mean_accepted_length: float,
        k: int,
        vocab_size: int,
        seed: int = 0,
    ) -> None:
        self.references = references
        self.alpha = alpha_for_mean(mean_accepted_length, k)
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.off_track: set[str] = set()

    def propose(self, batch: ScheduledBatch, limits: list[int]) -> Drafts:
        drafts = []
        for item, k in zip(batch.items, limits, strict=True):
            drafts.append(self._draft(item.seq, k) if k > 0 else [])
        return Drafts(drafts)

    def _draft(self, seq: Any, k: int) -> list[int]:
        rid, out = seq.request_id, seq.output_token_ids
        ref = self.references[rid]
        n = len(out)
        if rid not in self.off_track and out != ref[:n]:
            self.off_track.add(rid)
        if rid in self.off_track or n >= len(ref):
            return [(out[-1] + 1) % self.vocab_size] * k
        run = 0
        while run < k and self.rng.random() < self.alpha:
            run += 1
        truth = ref[n : n + k]
        run = min(run, len(truth))
        if run == k:
            return truth
        wrong = (truth[run] + 1) % self.vocab_size if run < len(truth) else 0
        return truth[:run] + [wrong] * (k - run)

    def release(self, request_id: str) -> None:
        pass


class TimedProposer:
    """`inner` with the wall time of each `propose` in `times` (the device synchronized before
    and after: what the step waits for); other attributes (`observe`, ...) pass through."""

    def __init__(self, inner: Proposer, cuda: bool) -> None:
        self.inner = inner
        self.method = inner.method
        self.cuda = cuda
        self.times: list[float] = []

    def propose(self, batch: ScheduledBatch, limits: list[int]) -> Drafts:
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        drafts = self.inner.propose(batch, limits)
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - start)
        return drafts

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
