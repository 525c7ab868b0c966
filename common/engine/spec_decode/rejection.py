"""Speculative verification in the sampler: each sequence keeps a prefix of its drafts and adds
one token of the target's own (`Sampler.plan_verify`, `Sampler.verify`, `verified_output`).

A sequence with k drafts has k + 1 logits rows; row j is the target's distribution after
output + drafts[:j], processed as a normal sampling row would be had drafts[:j] been sampled:
penalties count them, min_tokens counts them, and the row draws with the key of draw index
len(output) + j. The sequence emits drafts[:n] and then the target token of row n, where n is
the number of leading drafts accepted:

- greedy: draft j + 1 is accepted iff it is row j's argmax, so the tokens are those sequential
  greedy sampling gives;
- sampled (Leviathan et al., 2023): draft d of row j is accepted with probability
  min(1, p_j(d) / q_j(d)) (the coin: `acceptance_uniform` of the row's key); the first
  rejected row draws from max(p_j - q_j, 0) by the row's exponential race; with every draft
  accepted the last row draws from p_k exactly as `Sampler.sample` draws (a sequence without
  drafts gets the very token `sample` gives). p_j is the tempered, top-k/top-p/min-p filtered
  target; q_j is one-hot on d when the drafts are deterministic.

Rows are laid out per sequence: `row_of[i, j]` is the logits row of sequence i's position j (its
last row for j > k_i, whose "draft" -1 is never accepted, so the leading-accept count stops).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.engine import sampling_ops as ops
from common.engine.device_copy import to_device

if TYPE_CHECKING:
    from common.engine.sampler import SamplingInputs, SamplingPlan
    from common.engine.token_counts import TokenCounts
    from common.protocol.sampling_params import SamplingParams


@dataclass
class VerifyPlan:
    """One verify step as device tensors (built on the host by `Sampler.plan_verify`)."""

    rows: SamplingPlan  # one sampling row per logits row, sequence by sequence
    num_drafts: list[int]  # k_i per sequence (host)
    width: int  # K_max + 1: columns of `VerifiedRows.token_ids`
    next_draft: torch.Tensor  # [R] int64: the draft row j checks (drafts[i][j]); -1 last rows
    layout: torch.Tensor  # [2, B, W] int64: row_of, and drafts[i][j] padded with -1
    # Sampled rows, as positions in `rows.sampled_rows` order: bonus (last) rows, and the rows
    # that check a draft [3, D_s]: position, draft token, its row in `draft_probs`.
    bonus_local: torch.Tensor | None = None
    draft_local: torch.Tensor | None = None
    # Penalties of drafted tokens in a row's own prefix: [4, N] (row, token, counts slot,
    # occurrences in the prefix) and [N, 3] penalties; the dense pass counts stored tokens only.
    corrections: torch.Tensor | None = None
    correction_penalties: torch.Tensor | None = None
    counted: torch.Tensor | None = None  # [2, P] penalised sequences and their counts slots
    logprob_pad: torch.Tensor | None = None  # [L] position i * W + j of each logprob row
    logprob_positions: list[tuple[int, int]] | None = None  # (i, j) of each logprob row


@dataclass
class VerifiedRows:
    """What `Sampler.verify` left on the device for one step."""

    token_ids: torch.Tensor  # [B, W] int64, the emitted tokens, -1 after them
    num_emitted: torch.Tensor  # [B] int64, 1..k_i + 1
    # [L, 1 + 2 * num_top] float32 per logprob row (`VerifyPlan.logprob_positions`)
    logprobs: torch.Tensor | None


@dataclass
class VerifiedOutput:
    token_ids: list[list[int]]  # per sequence, its emitted tokens in order
    # Per sequence, one entry per emitted token (raw-logit logprob; the N best (token,
    # logprob)); None for sequences that did not ask, and None as a whole when none asked.
    logprobs: list[list[float] | None] | None
    top_logprobs: list[list[list[tuple[int, float]]] | None] | None


class _Extended(Sequence[int]):
    """output + drafts[:j] without copying the output: after a request's first sampling the
    planner reads only its length."""

    def __init__(self, base: Sequence[int], extra: list[int]) -> None:
        self.base, self.extra = base, extra

    def __len__(self) -> int:
        return len(self.base) + len(self.extra)

    def __getitem__(self, index: int | slice) -> int | list[int]:  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = index + len(self) if index < 0 else index
        n = len(self.base)
        return self.base[index] if index < n else self.extra[index - n]


def check_drafts(drafts: list[list[int]], num_seqs: int, vocab_size: int) -> None:
    """ValueError unless there is one draft list per sequence, of tokens in [0, vocab_size)."""
    if len(drafts) != num_seqs:
        raise ValueError(f"{len(drafts)} draft lists for {num_seqs} sequences")
    for i, draft in enumerate(drafts):
        if draft and not 0 <= min(draft) <= max(draft) < vocab_size:
            raise ValueError(f"sequence {i}: draft tokens {draft} outside [0, {vocab_size})")


def expand_inputs(
    inputs: SamplingInputs, request_ids: list[str], drafts: list[list[int]]
) -> SamplingInputs:
    """One sampling row per verified position: sequence i's row j sees output + drafts[:j]."""
    from common.engine.sampler import SamplingInputs

    rows = SamplingInputs([], [], [], [], [])
    for i, draft in enumerate(drafts):
        output = inputs.output_token_ids[i]
        for j in range(len(draft) + 1):
            rows.params.append(inputs.params[i])
            rows.prompt_token_ids.append(inputs.prompt_token_ids[i])
            rows.output_token_ids.append(_Extended(output, draft[:j]) if j else output)
            rows.eos_token_ids.append(inputs.eos_token_ids[i])
            rows.request_ids.append(request_ids[i])
    return rows


def build_plan(
    rows: SamplingPlan,
    inputs: SamplingInputs,
    drafts: list[list[int]],
    slots: dict[int, int],
    device: torch.device,
) -> VerifyPlan:
    """The verify layout around the rows' sampling plan; `slots`: the counts slot of each
    penalised sequence."""
    ks = [len(d) for d in drafts]
    width = max(ks, default=0) + 1
    next_draft: list[int] = []
    row_of: list[list[int]] = []
    pad: list[list[int]] = []
    start = 0
    starts = []
    for draft, k in zip(drafts, ks, strict=True):
        starts.append(start)
        next_draft += draft + [-1]
        row_of.append([start + min(j, k) for j in range(width)])
        pad.append(draft + [-1] * (width - k))
        start += k + 1

    def ints(values: list) -> torch.Tensor:
        return to_device(values, torch.int64, device)

    plan = VerifyPlan(rows, ks, width, ints(next_draft), ints([row_of, pad]))
    params = inputs.params
    bonus: list[int] = []
    checks: list[list[int]] = [[], [], []]
    local, ordinal = 0, 0
    for i, (draft, k) in enumerate(zip(drafts, ks, strict=True)):
        if not params[i].greedy:
            for j, token in enumerate(draft):
                for column, value in enumerate((local + j, token, ordinal + j)):
                    checks[column].append(value)
            bonus.append(local + k)
            local += k + 1
        ordinal += k
    if bonus:
        plan.bonus_local = ints(bonus)
    if checks[0]:
        plan.draft_local = ints(checks)
    _plan_penalties(plan, params, drafts, starts, slots, ints)
    lp = [(i, j) for i, k in enumerate(ks) if params[i].logprobs is not None for j in range(k + 1)]
    if lp:
        plan.logprob_positions = lp
        plan.logprob_pad = ints([i * width + j for i, j in lp])
    return plan


def _plan_penalties(
    plan: VerifyPlan,
    params: list[SamplingParams],
    drafts: list[list[int]],
    starts: list[int],
    slots: dict[int, int],
    ints: Callable[[list], torch.Tensor],
) -> None:
    if not slots:
        return
    plan.counted = ints([list(slots), list(slots.values())])
    columns: list[list[int]] = [[], [], [], []]
    penalties = []
    for i, slot in slots.items():
        p = params[i]
        for j in range(1, len(drafts[i]) + 1):
            for token, extra in Counter(drafts[i][:j]).items():
                for column, value in zip(columns, (starts[i] + j, token, slot, extra), strict=True):
                    column.append(value)
                penalties.append([p.repetition_penalty, p.frequency_penalty, p.presence_penalty])
    if penalties:
        plan.corrections = ints(columns)
        plan.correction_penalties = to_device(penalties, torch.float32, plan.next_draft.device)


def draft_penalties(
    logits: torch.Tensor, plan: VerifyPlan, counts: TokenCounts
) -> torch.Tensor | None:
    """The penalised logits of each (row, drafted token) pair, counting the token's occurrences
    in the row's draft prefix; read before the dense pass, written over it after."""
    if plan.corrections is None:
        return None
    rows, tokens, slots, extra = plan.corrections
    count = counts.counts[slots, tokens] + extra.to(torch.int32)
    seen = counts.prompt_seen[slots, tokens]
    rep, freq, pres = plan.correction_penalties.unbind(1)
    x = logits[rows, tokens].unsqueeze(1)
    return ops.apply_penalties_(x, count.unsqueeze(1), seen.unsqueeze(1), rep, freq, pres)[:, 0]


def sampled_targets(
    logits: torch.Tensor, plan: VerifyPlan, draft_probs: torch.Tensor | None, salts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the sampled rows (`rows.sampled_rows` order): the token each emits if its sequence
    stops there, and whether it accepts its draft. Consumes `logits` (after the penalties)."""
    base = plan.rows
    x = logits if base.sampled_all else logits[base.sampled_rows]
    temperature, top_p, min_p = base.filters.unbind(1)
    x.div_(temperature.unsqueeze(1))
    if base.k_max:
        ops.top_k_mask_(x, base.top_k, base.k_max)
    tokens = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    accept = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    keys = base.row_keys
    if plan.draft_local is not None:
        local, drafted, ordinal = plan.draft_local
        p = x[local]
        if base.uses_top_p:
            ops.top_p_mask_(p, top_p[local])
        if base.uses_min_p:
            ops.min_p_mask_(p, min_p[local])
        p = p.softmax(dim=-1)
        column = drafted.unsqueeze(1)
        if draft_probs is None:
            q_drafted = torch.ones_like(temperature[local])
            residual = p.scatter(1, column, 0.0)
        else:
            q = draft_probs[ordinal]
            q_drafted = q.gather(1, column)[:, 0]
            residual = (p - q).clamp_(min=0.0)
        # u < p / q without dividing (q may round to 0 where p does too).
        accept_here = ops.acceptance_uniform(keys[local]) * q_drafted < p.gather(1, column)[:, 0]
        # p == q leaves no residual mass (then the draft is always accepted): race p instead.
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p, residual)
        tokens.index_copy_(0, local, ops.race_probs(residual, keys[local], salts))
        accept.index_copy_(0, local, accept_here)
        x = x[plan.bonus_local]
        top_p, min_p, keys = (
            top_p[plan.bonus_local],
            min_p[plan.bonus_local],
            keys[plan.bonus_local],
        )
    bonus = ops.filtered_race(
        x, top_p if base.uses_top_p else None, min_p if base.uses_min_p else None, keys, salts
    )
    tokens.index_copy_(0, plan.bonus_local, bonus)
    return tokens, accept


def emitted(
    target: torch.Tensor, accept: torch.Tensor, plan: VerifyPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: drafts[:n], then the target token of row n (n leading accepts); -1 after.
    Returns token_ids [B, W] and num_emitted [B] = n + 1."""
    row_of, pad = plan.layout
    n = accept[row_of].to(torch.int64).cumprod(dim=1).sum(dim=1, keepdim=True)
    position = torch.arange(plan.width, device=target.device).unsqueeze(0)
    filler = torch.full_like(pad, -1)
    tokens = torch.where(position < n, pad, torch.where(position == n, target[row_of], filler))
    return tokens, n[:, 0] + 1


def verified_output(
    token_ids: list[list[int]],
    num_emitted: list[int],
    packed: list[list[float]] | None,
    plan: VerifyPlan,
) -> VerifiedOutput:
    """VerifiedOutput from `VerifiedRows` values already on the host."""
    tokens = [row[:n] for row, n in zip(token_ids, num_emitted, strict=True)]
    if packed is None:
        return VerifiedOutput(tokens, None, None)
    seqs = len(num_emitted)
    logprobs: list[list[float] | None] = [None] * seqs
    tops: list[list[list[tuple[int, float]]] | None] = [None] * seqs
    n = plan.rows.num_top
    for (i, j), values, count in zip(
        plan.logprob_positions, packed, plan.rows.top_counts, strict=True
    ):
        if j == 0:
            logprobs[i], tops[i] = [], []
        if j >= num_emitted[i]:
            continue
        logprobs[i].append(values[0])
        count = min(count, n)
        tops[i].append([(int(values[1 + t]), values[1 + n + t]) for t in range(count)])
    return VerifiedOutput(tokens, logprobs, tops)


def verified_to_host(out: VerifiedRows, plan: VerifyPlan) -> VerifiedOutput:
    """Read a verify step's results back (syncs with the device)."""
    packed = None if out.logprobs is None else out.logprobs.tolist()
    return verified_output(out.token_ids.tolist(), out.num_emitted.tolist(), packed, plan)
