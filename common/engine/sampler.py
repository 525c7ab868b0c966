"""Batched, on-device token sampling: one token per row of a [R, V] logits tensor.

`Sampler.plan` (host) turns one step's rows into a few small device tensors; `Sampler.sample`
(device) then runs with no host sync and no Python loop over rows or the vocabulary:

1. logprobs, only for the rows that ask, from log_softmax of the raw logits (vLLM's default);
2. repetition, frequency and presence penalties from on-device token counts (`TokenCounts`,
   one row per request that uses them, updated on the device with every sampled token), and
   the min_tokens mask;
3. greedy rows take the argmax;
4. the other rows: temperature, then top-k (`topk` threshold), top-p (exact bisection on the
   float bits, no sort) and min-p, each only when some row uses it;
5. one draw per row by the exponential race, the noise a hash of (request key, draw index,
   token): every seeded row in one launch, independent of its batch neighbours, and the
   decode node continues a request the prefill node started bit-exactly (`sampling_ops`).

`plan_verify` / `verify` do the same for a speculative step, several rows per sequence, and
keep a prefix of its drafts (`common.engine.spec_decode.rejection`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.engine import sampling_ops as ops
from common.engine.device_copy import to_device
from common.engine.spec_decode import rejection
from common.engine.spec_decode.rejection import VerifiedOutput as VerifiedOutput
from common.engine.spec_decode.rejection import VerifiedRows, VerifyPlan
from common.engine.spec_decode.rejection import verified_output as verified_output
from common.engine.spec_decode.rejection import verified_to_host as verified_to_host
from common.engine.token_counts import TokenCounts
from common.protocol.sampling_params import SamplingParams

_SEED_SOURCE = random.SystemRandom()


@dataclass
class SamplingInputs:
    """Per-row inputs for one sampling call; row i lines up with logits row i.

    Token ids must be < V (the logits' width), except EOS and stop ids: those >= V can never be
    sampled, so they are skipped by the min_tokens mask. `output_token_ids[i]` may end in
    placeholders of tokens not yet on the host (overlapped decoding): only its length is read
    after the request's first sampling.
    """

    params: list[SamplingParams]
    prompt_token_ids: list[Sequence[int]]  # read once per request, by repetition_penalty
    output_token_ids: list[Sequence[int]]  # its length is the draw index; read once (penalties)
    eos_token_ids: list[Sequence[int]]  # masked with stop ids while len(output) < min_tokens
    # Who owns each row's sampler state (noise key, token counts); None: state for this call
    # only. The caller calls `Sampler.release` once a request has ended.
    request_ids: list[str] | None = None


@dataclass
class SamplingPlan:
    """One step's rows as device tensors (built on the host by `Sampler.plan`)."""

    num_rows: int
    greedy_only: bool = True  # every row greedy, nothing else to apply: just the argmax
    logprob_rows: list[int] | None = None  # rows that asked for logprobs (host)
    logprob_index: torch.Tensor | None = None  # the same rows, on the device
    num_top: int = 0  # most top logprobs any row asked for
    top_counts: list[int] | None = None  # per logprob row: how many top logprobs it asked for
    penalty_rows: torch.Tensor | None = None
    penalty_slots: torch.Tensor | None = None
    penalties: torch.Tensor | None = None  # [P, 3] repetition, frequency, presence
    blocked: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids): min_tokens
    sampled_rows: torch.Tensor | None = None  # non-greedy rows
    sampled_all: bool = False  # every row is non-greedy
    filters: torch.Tensor | None = None  # [S, 3] temperature, top_p, min_p
    top_k: torch.Tensor | None = None  # [S] int64
    k_max: int = 0  # 0: no row uses top-k
    uses_top_p: bool = False
    uses_min_p: bool = False
    row_keys: torch.Tensor | None = None  # [S] int64 noise keys
    ephemeral: tuple[str, ...] = ()  # request ids whose state ends with this call


@dataclass
class SampledRows:
    """What `Sampler.sample` left on the device for one step."""

    token_ids: torch.Tensor  # [R] int64
    # [L, 1 + 2 * num_top] float32 per logprob row: sampled logprob, top ids, top logprobs
    logprobs: torch.Tensor | None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Raw-logit logprob of each row's sampled token; None for rows that did not ask, and None as
    # a whole when no row asked.
    logprobs: list[float | None] | None
    # Per row: the N best (token, logprob), best first, when params.logprobs=N (N=0 -> []);
    # None for rows that did not ask. The whole field is None when no row asked.
    top_logprobs: list[list[tuple[int, float]] | None] | None


class Sampler:
    """Holds per-request sampler state (noise keys, token-count rows) on one device."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.salts = ops.token_salts(vocab_size, device)
        self.counts = TokenCounts(vocab_size, device)
        self._neg_inf = torch.tensor(ops.NEG_INF, device=device)
        self._keys: dict[str, int] = {}
        self._ephemeral = 0

    def release(self, request_id: str) -> None:
        self._keys.pop(request_id, None)
        self.counts.release(request_id)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, inputs: SamplingInputs) -> SamplerOutput:
        """Plan, sample and read back in one go (tests, simple callers). Leaves `logits` as is."""
        plan = self.plan(inputs, logits.shape)
        out = self.sample(logits.clone(), plan)
        return to_host(out, plan)

    # -- host: one step's plan ----------------------------------------------------------------
    def plan(self, inputs: SamplingInputs, shape: tuple[int, ...] | None = None) -> SamplingPlan:
        params = inputs.params
        rows = len(params)
        _check_rows(inputs, shape)
        ids = inputs.request_ids
        ephemeral = []
        if ids is None:
            ids = ephemeral = self._call_ids(rows)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        blocked = self._blocked(inputs)
        pen_rows = [i for i, p in enumerate(params) if p.uses_penalties]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        plan = SamplingPlan(rows, not (lp_rows or blocked or pen_rows or sampled))
        plan.ephemeral, plan.sampled_all = tuple(ephemeral), len(sampled) == rows
        if lp_rows:
            plan.logprob_rows, plan.logprob_index = lp_rows, self._ints(lp_rows)
            plan.top_counts = [params[i].logprobs for i in lp_rows]
            plan.num_top = min(max(plan.top_counts), self.vocab_size)
        if blocked:
            plan.blocked = (self._ints(blocked[0]), self._ints(blocked[1]))
        if pen_rows:
            slots = [
                self.counts.slot(
                    ids[i], inputs.prompt_token_ids[i], inputs.output_token_ids[i], params[i]
                )
                for i in pen_rows
            ]
            plan.penalty_rows, plan.penalty_slots = self._ints(pen_rows), self._ints(slots)
            plan.penalties = self._floats(
                [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
                 for p in (params[i] for i in pen_rows)]
            )  # fmt: skip
        if sampled:
            self._plan_sampled(plan, inputs, ids, sampled)
        return plan

    def _call_ids(self, rows: int) -> list[str]:
        """Request ids whose sampler state lives for one call."""
        self._ephemeral += 1
        return [f"\0call-{self._ephemeral}-{i}" for i in range(rows)]

    def plan_verify(
        self,
        inputs: SamplingInputs,
        drafts: list[list[int]],
        shape: tuple[int, ...] | None = None,
    ) -> VerifyPlan:
        """A verify step's plan: `inputs` has one row per sequence (its output without the
        drafts), `drafts[i]` its drafted tokens; the logits have sum(len(drafts[i]) + 1) rows,
        sequence i's consecutive (`rejection`)."""
        _check_rows(inputs, None)
        rejection.check_drafts(drafts, len(inputs.params), self.vocab_size)
        num_rows = len(drafts) + sum(map(len, drafts))
        if shape is not None and (len(shape) != 2 or shape[0] != num_rows):
            raise ValueError(
                f"logits shape {shape} does not match {len(drafts)} sequences with "
                f"{sum(map(len, drafts))} drafts ({num_rows} rows)"
            )
        if all(map(_argmax_only, inputs.params, inputs.output_token_ids)):
            # What `plan` gives the expanded rows, without expanding them (the common case).
            return rejection.build_plan(SamplingPlan(num_rows), inputs, drafts, {}, self.device)
        ids = inputs.request_ids
        ephemeral: list[str] = []
        if ids is None:
            ids = ephemeral = self._call_ids(len(inputs.params))
        rows = rejection.expand_inputs(inputs, ids, drafts)
        plan = self.plan(rows, shape)
        plan.ephemeral = tuple(ephemeral)
        slots = {
            i: self.counts.slot(
                ids[i], inputs.prompt_token_ids[i], inputs.output_token_ids[i], params
            )
            for i, params in enumerate(inputs.params)
            if params.uses_penalties
        }
        return rejection.build_plan(plan, inputs, drafts, slots, self.device)

    def _plan_sampled(
        self, plan: SamplingPlan, inputs: SamplingInputs, ids: list[str], rows: list[int]
    ) -> None:
        params = [inputs.params[i] for i in rows]
        plan.sampled_rows = self._ints(rows)
        plan.filters = self._floats([[p.temperature, p.top_p, p.min_p] for p in params])
        plan.k_max = max((p.top_k for p in params if 0 < p.top_k < self.vocab_size), default=0)
        if plan.k_max:
            plan.top_k = self._ints([p.top_k for p in params])
        plan.uses_top_p = any(p.top_p < 1.0 for p in params)
        plan.uses_min_p = any(p.min_p > 0.0 for p in params)
        keys = []
        for i, p in zip(rows, params, strict=True):
            key = self._keys.get(ids[i])
            if key is None:
                key = self._keys[ids[i]] = (
                    p.seed if p.seed is not None else _SEED_SOURCE.getrandbits(63)
                )
            keys.append(ops.draw_key(key, len(inputs.output_token_ids[i])))
        plan.row_keys = self._ints(keys)

    def _blocked(self, inputs: SamplingInputs) -> tuple[list[int], list[int]] | None:
        rows: list[int] = []
        cols: list[int] = []
        for i, (p, output, eos) in enumerate(
            zip(inputs.params, inputs.output_token_ids, inputs.eos_token_ids, strict=True)
        ):
            if len(output) >= p.min_tokens:
                continue
            stop = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos))
            ids = [t for t in stop if t < self.vocab_size]
            rows += [i] * len(ids)
            cols += ids
        return (rows, cols) if cols else None

    def _ints(self, values: list[int]) -> torch.Tensor:
        return to_device(values, torch.int64, self.device)

    def _floats(self, values: list) -> torch.Tensor:
        return to_device(values, torch.float32, self.device)

    # -- device: one step ---------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, plan: SamplingPlan) -> SampledRows:
        """One token per row; consumes `logits` (float32 [R, V], modified in place). Updates
        the token counts of the penalised rows, on the device, before returning."""
        if plan.greedy_only:
            self._end(plan)
            return SampledRows(logits.argmax(dim=-1), None)
        raw = None
        if plan.logprob_index is not None:
            raw = torch.log_softmax(logits[plan.logprob_index], dim=-1)
        self._adjust(logits, plan)
        token_ids = logits.argmax(dim=-1)  # final for greedy rows
        if plan.sampled_rows is not None:
            chosen = self._sample_rows(logits, plan)
            if plan.sampled_all:
                token_ids = chosen
            else:
                token_ids.index_copy_(0, plan.sampled_rows, chosen)
        if plan.penalty_rows is not None:
            self.counts.add(plan.penalty_slots, token_ids[plan.penalty_rows])
        packed = None
        if raw is not None:
            packed = _pack_logprobs(raw, token_ids[plan.logprob_index], plan.num_top)
        self._end(plan)
        return SampledRows(token_ids, packed)

    def verify(
        self, logits: torch.Tensor, plan: VerifyPlan, draft_probs: torch.Tensor | None = None
    ) -> VerifiedRows:
        """Accept a prefix of each sequence's drafts and add one token; consumes `logits`
        (float32 [R, V]). `draft_probs` [D, V] float32: the distribution each draft was
        sampled from (None: deterministic drafts). Adds the emitted tokens to the penalised
        requests' token counts, on the device."""
        rows = plan.rows
        drafts = sum(plan.num_drafts)
        if draft_probs is not None and tuple(draft_probs.shape) != (drafts, self.vocab_size):
            raise ValueError(
                f"draft_probs shape {tuple(draft_probs.shape)} is not ({drafts}, "
                f"{self.vocab_size}) for drafts {plan.num_drafts}"
            )
        raw = None
        if rows.logprob_index is not None:
            raw = torch.log_softmax(logits[rows.logprob_index], dim=-1)
        fixed = rejection.draft_penalties(logits, plan, self.counts)
        self._penalize(logits, rows)
        if fixed is not None:
            logits.index_put_(tuple(plan.corrections[:2]), fixed)
        self._block(logits, rows)
        target = logits.argmax(dim=-1)  # final for greedy rows
        accept = target == plan.next_draft
        if rows.sampled_rows is not None:
            tokens, accepted = rejection.sampled_targets(logits, plan, draft_probs, self.salts)
            target.index_copy_(0, rows.sampled_rows, tokens)
            accept.index_copy_(0, rows.sampled_rows, accepted)
        token_ids, num_emitted = rejection.emitted(target, accept, plan)
        if plan.counted is not None:
            seqs, slots = plan.counted
            self.counts.add_rows(slots, token_ids[seqs])
        packed = None
        if raw is not None:
            chosen = token_ids.view(-1)[plan.logprob_pad].clamp(min=0)
            packed = _pack_logprobs(raw, chosen, rows.num_top)
        self._end(rows)
        return VerifiedRows(token_ids, num_emitted, packed)

    def _adjust(self, logits: torch.Tensor, plan: SamplingPlan) -> None:
        """Penalties and the min_tokens mask, in place."""
        self._penalize(logits, plan)
        self._block(logits, plan)

    def _penalize(self, logits: torch.Tensor, plan: SamplingPlan) -> None:
        if plan.penalty_rows is not None:
            ops.apply_penalties_to_rows_(
                logits,
                plan.penalty_rows,
                plan.penalty_slots,
                self.counts.counts,
                self.counts.prompt_seen,
                plan.penalties,
            )

    def _block(self, logits: torch.Tensor, plan: SamplingPlan) -> None:
        if plan.blocked is not None:
            # index_put_ of a device scalar: assigning a Python float would copy it to the
            # device and wait for the step in flight.
            logits.index_put_(plan.blocked, self._neg_inf)

    @torch.inference_mode()
    def penalized(self, logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
        """A copy of `logits` with the penalties and the min_tokens mask applied: what greedy
        rows take the argmax of (for tests and debugging; counts are not advanced)."""
        plan = self.plan(inputs, tuple(logits.shape))
        out = logits.to(torch.float32, copy=True)
        self._adjust(out, plan)
        self._end(plan)
        return out

    def _sample_rows(self, logits: torch.Tensor, plan: SamplingPlan) -> torch.Tensor:
        x = logits if plan.sampled_all else logits[plan.sampled_rows]
        temperature, top_p, min_p = plan.filters.unbind(1)
        x.div_(temperature.unsqueeze(1))
        if plan.k_max:
            ops.top_k_mask_(x, plan.top_k, plan.k_max)
        return ops.filtered_race(
            x,
            top_p if plan.uses_top_p else None,
            min_p if plan.uses_min_p else None,
            plan.row_keys,
            self.salts,
        )

    def _end(self, plan: SamplingPlan) -> None:
        for request_id in plan.ephemeral:
            self.release(request_id)


def _pack_logprobs(raw: torch.Tensor, chosen: torch.Tensor, num_top: int) -> torch.Tensor:
    sampled = raw.gather(1, chosen.unsqueeze(1))
    if num_top == 0:
        return sampled
    values, ids = raw.topk(num_top, dim=-1)  # sorted, best first
    return torch.cat([sampled, ids.to(torch.float32), values], dim=1)


def to_host(out: SampledRows, plan: SamplingPlan) -> SamplerOutput:
    """Read a step's results back (syncs with the device)."""
    return host_output(
        out.token_ids.tolist(), None if out.logprobs is None else out.logprobs.tolist(), plan
    )


def host_output(
    token_ids: list[int], packed: list[list[float]] | None, plan: SamplingPlan
) -> SamplerOutput:
    """SamplerOutput from values already on the host (`packed`: the rows of
    `SampledRows.logprobs`)."""
    if packed is None:
        return SamplerOutput(token_ids, None, None)
    logprobs: list[float | None] = [None] * plan.num_rows
    tops: list[list[tuple[int, float]] | None] = [None] * plan.num_rows
    n = plan.num_top
    for row, values, count in zip(plan.logprob_rows, packed, plan.top_counts, strict=True):
        logprobs[row] = values[0]
        count = min(count, n)
        tops[row] = [(int(values[1 + j]), values[1 + n + j]) for j in range(count)]
    return SamplerOutput(token_ids, logprobs, tops)


def _argmax_only(params: SamplingParams, output: Sequence[int]) -> bool:
    """A row of these params takes the plain argmax (no draw, penalty, logprobs or min_tokens
    mask), and so does every later row of its sequence (outputs only grow)."""
    return (
        params.greedy
        and params.logprobs is None
        and not params.uses_penalties
        and len(output) >= params.min_tokens
    )


def _check_rows(inputs: SamplingInputs, shape: tuple[int, ...] | None) -> None:
    fields = ("params", "prompt_token_ids", "output_token_ids", "eos_token_ids")
    lengths = {name: len(getattr(inputs, name)) for name in fields}
    if inputs.request_ids is not None:
        lengths["request_ids"] = len(inputs.request_ids)
    rows = len(inputs.params) if shape is None else shape[0]
    if (shape is not None and len(shape) != 2) or any(n != rows for n in lengths.values()):
        raise ValueError(f"logits shape {shape} does not match the per-row inputs {lengths}")
