"""Batched, on-device token sampling: one token per row of a [B, V] logits tensor.

Steps, in order, on float32 copies on the logits' device, with no Python loop over the vocabulary:

1. logprobs (when some row asks) from log_softmax of the raw logits, as vLLM does by default;
2. repetition, frequency and presence penalties, and the min_tokens mask (`apply_penalties`);
3. greedy rows take the argmax here and skip the rest;
4. temperature, then top-k, top-p and min-p, each only when some row uses it;
5. one draw per row by the exponential race: argmax(probs / q) with q ~ Exponential(1).

Seeded requests draw q from their own `torch.Generator`, so their tokens depend only on their seed
and history, never on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingInputs:
    """Per-row inputs for one sampling call; row i lines up with logits row i.

    Token ids must be < V (the logits' width), except EOS and stop ids: those >= V can never be
    sampled, so they are skipped by the min_tokens mask.
    """

    params: list[SamplingParams]
    prompt_token_ids: list[Sequence[int]]  # read by repetition_penalty
    output_token_ids: list[Sequence[int]]  # read by all three penalties and by min_tokens
    # Per-request generator (None = default RNG), on the logits' device. The caller owns it and
    # keeps it across steps; each non-greedy step advances it by exactly one draw of V values.
    generators: list[torch.Generator | None]
    # Masked with stop_token_ids while len(output) < min_tokens; ignore_eos leaves EOS unmasked.
    eos_token_ids: list[Sequence[int]]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Raw-logit logprob of each row's sampled token; None when no row asked for logprobs.
    logprobs: list[float] | None
    # Per row: the N best (token, logprob), best first, when params.logprobs=N (N=0 -> []);
    # None for rows that did not ask. The whole field is None when no row asked.
    top_logprobs: list[list[tuple[int, float]] | None] | None


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded with `seed` on `device`, or None (use the default RNG) when unseeded."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Stateless, so one instance can serve every batch; randomness state lives in the inputs."""

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, inputs: SamplingInputs) -> SamplerOutput:
        params = inputs.params
        if all(
            p.greedy and p.logprobs is None and not p.uses_penalties and p.min_tokens == 0
            for p in params
        ):
            _check_rows(logits, inputs)
            return SamplerOutput(logits.argmax(dim=-1).tolist(), None, None)  # plain greedy
        wants_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if wants_logprobs else None

        logits = apply_penalties(logits, inputs)
        token_ids = logits.argmax(dim=-1)  # final for greedy rows; sampled rows are overwritten
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            if len(sampled) == len(params):
                token_ids = _sample(logits, params, inputs.generators)
            else:
                rows = torch.tensor(sampled, device=logits.device)
                token_ids[rows] = _sample(
                    logits[rows],
                    [params[i] for i in sampled],
                    [inputs.generators[i] for i in sampled],
                )

        if raw_logprobs is None:
            return SamplerOutput(token_ids.tolist(), None, None)
        logprobs, top_logprobs = _gather_logprobs(raw_logprobs, token_ids, params)
        return SamplerOutput(token_ids.tolist(), logprobs, top_logprobs)


def apply_penalties(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    """Returns a float32 copy of `logits` [B, V] with the penalties and min_tokens mask applied.

    repetition_penalty r (HF): for tokens in prompt or output, logit > 0 -> logit / r, else * r.
    frequency f / presence p (OpenAI): logit -= f * count_in_output + p * (count_in_output > 0).
    min_tokens: while len(output) < min_tokens, stop_token_ids (and EOS unless ignore_eos) -> -inf.
    """
    _check_rows(logits, inputs)
    logits = logits.to(torch.float32, copy=True)
    params = inputs.params
    rows, vocab = logits.shape
    device = logits.device
    uses_repetition = any(p.repetition_penalty != 1.0 for p in params)
    uses_counts = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)

    if uses_repetition or uses_counts:
        output_ids = _padded_ids(inputs.output_token_ids, vocab, device)
    if uses_repetition:
        prompt_ids = _padded_ids(inputs.prompt_token_ids, vocab, device)
        seen_ids = torch.cat([prompt_ids, output_ids], dim=1)
        seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=device)
        seen = seen.scatter_(1, seen_ids, True)[:, :vocab]
        r = _column([p.repetition_penalty for p in params], device)
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if uses_counts:
        counts = torch.zeros(rows, vocab + 1, device=device)
        counts = counts.scatter_add_(
            1, output_ids, torch.ones_like(output_ids, dtype=torch.float32)
        )
        counts = counts[:, :vocab]
        frequency = _column([p.frequency_penalty for p in params], device)
        presence = _column([p.presence_penalty for p in params], device)
        logits -= frequency * counts + presence * (counts > 0)

    _mask_stop_ids_before_min_tokens(logits, inputs)
    return logits


def _mask_stop_ids_before_min_tokens(logits: torch.Tensor, inputs: SamplingInputs) -> None:
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, (params, output, eos) in enumerate(
        zip(inputs.params, inputs.output_token_ids, inputs.eos_token_ids, strict=True)
    ):
        if len(output) >= params.min_tokens:
            continue
        blocked = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos))
        ids = [t for t in blocked if t < vocab]
        rows += [i] * len(ids)
        cols += ids
    if cols:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = _NEG_INF


def _sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """One token per row of `logits` [S, V] (float32, owned by the caller, modified in place)."""
    device = logits.device
    logits.div_(_column([p.temperature for p in params], device))
    logits = _apply_top_k_top_p(logits, params)
    if any(p.min_p > 0.0 for p in params):
        probs = logits.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * _column([p.min_p for p in params], device)
        logits.masked_fill_(probs < floor, _NEG_INF)
    probs = logits.softmax(dim=-1)
    return probs.div_(_exponential_noise(probs, generators)).argmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Sets tokens outside each row's top-k, then outside its top-p nucleus, to -inf (in place)."""
    rows, vocab = logits.shape
    uses_k = any(0 < p.top_k < vocab for p in params)
    uses_p = any(p.top_p < 1.0 for p in params)
    if not (uses_k or uses_p):
        return logits
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if uses_k:
        k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
        rank = torch.arange(vocab, device=device)
        sorted_logits.masked_fill_(rank >= k.unsqueeze(1), _NEG_INF)
    if uses_p:
        probs = sorted_logits.softmax(dim=-1)
        # Mass of the strictly more likely tokens: 0 for the first, so the best token always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        # inf disables the filter for top_p == 1 rows, where cumsum rounding could reach 1.0.
        top_p = _column([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device)
        sorted_logits.masked_fill_(mass_before >= top_p, _NEG_INF)
    # `order` is a permutation of each row, so every slot is written back.
    return logits.scatter_(1, order, sorted_logits)


def skip_draws(
    generator: torch.Generator, vocab_size: int, device: torch.device, steps: int
) -> None:
    """Advance a seeded generator past `steps` sampled tokens, as if this sampler drew them.

    A decode node continues a seeded request whose first token was sampled elsewhere; skipping
    that draw keeps its tokens identical to a single-process run.
    """
    for _ in range(steps):
        torch.empty(vocab_size, device=device).exponential_(generator=generator)


def _exponential_noise(
    probs: torch.Tensor, generators: list[torch.Generator | None]
) -> torch.Tensor:
    """q ~ Exponential(1) shaped like `probs`; seeded rows draw from their own generator."""
    q = torch.empty_like(probs)
    if any(g is None for g in generators):
        q.exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            q[i] = torch.empty(probs.shape[1], device=probs.device).exponential_(
                generator=generator
            )
    # A zero draw would turn a filtered token's 0 / 0 into NaN, which argmax would pick.
    return q.clamp_min_(torch.finfo(q.dtype).tiny)


def _gather_logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
) -> tuple[list[float], list[list[tuple[int, float]] | None]]:
    sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    n_max = min(max(p.logprobs or 0 for p in params), raw_logprobs.shape[1])
    values, ids = raw_logprobs.topk(n_max, dim=-1)  # sorted, best first
    values, ids = values.tolist(), ids.tolist()
    top: list[list[tuple[int, float]] | None] = [
        None
        if p.logprobs is None
        else list(zip(ids[i][: p.logprobs], values[i][: p.logprobs], strict=True))
        for i, p in enumerate(params)
    ]
    return sampled, top


def _padded_ids(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[B, max_len] int64 ids, short rows padded with `pad`."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row):
            ids[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return ids.to(device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _check_rows(logits: torch.Tensor, inputs: SamplingInputs) -> None:
    fields = ("params", "prompt_token_ids", "output_token_ids", "generators", "eos_token_ids")
    lengths = {name: len(getattr(inputs, name)) for name in fields}
    if logits.dim() != 2 or any(n != logits.shape[0] for n in lengths.values()):
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match the per-row inputs {lengths}"
        )
