"""The sampler's tensor operations: sort-free filters, penalties and counter-based noise.

Everything here is batched over rows with no Python loop over rows or the vocabulary, has
data-independent control flow (no host sync), and treats each row on its own, so a row's
result does not depend on which rows share its batch. These torch versions run on every
device and are the reference; on CUDA `race` and `top_p_mask_` use the Triton kernels of
`common.model.kernels.sampling` (the race in one pass over [S, V] instead of ~20 kernels; top-p in 8
passes of a 17-way search instead of 31 bisection steps).

Noise: a row's draw is a pure function of (its request's key, its draw index, the token id):
`hash32(salt[token] ^ row_key)`, where `row_key = draw_key(request key, draw index)` and the
draw index is the number of tokens the request had already sampled. So a seeded request gets
the same noise whatever its batch, on any node, after a preemption, and whether the decode loop
overlaps or not, with no per-request generator state to carry or skip.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

M32 = 0xFFFFFFFF
_HASH_MUL_1 = 0x7FEB352D
_HASH_MUL_2 = 0x846CA68B
TOP_P_ITERATIONS = 31  # bisection steps over float32 bit patterns: exact for every [0, 2^31)
NEG_INF = float("-inf")


# -- counter-based noise --------------------------------------------------------------------


def hash32_int(x: int) -> int:
    """lowbias32 (a 32-bit integer hash with good avalanche) on a Python int."""
    x &= M32
    x ^= x >> 16
    x = (x * _HASH_MUL_1) & M32
    x ^= x >> 15
    x = (x * _HASH_MUL_2) & M32
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without overflowing int64 (16-bit halves)."""
    high = (((x >> 16) * c) & 0xFFFF) << 16
    return (high + (x & 0xFFFF) * c) & M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int64 tensor of values in [0, 2^32); bit-identical to `hash32_int`."""
    x = x ^ (x >> 16)
    x = _mul32(x, _HASH_MUL_1)
    x = x ^ (x >> 15)
    x = _mul32(x, _HASH_MUL_2)
    return x ^ (x >> 16)


def draw_key(request_key: int, draw_index: int) -> int:
    """The 32-bit key of one draw of a request (host side, once per row and step)."""
    mixed = hash32_int(draw_index ^ hash32_int(request_key >> 32))
    return hash32_int(mixed ^ (request_key & M32))


def token_salts(vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """hash32 of every token id, [V] int64: the per-token half of the noise (computed once)."""
    return hash32(torch.arange(vocab_size, dtype=torch.int64, device=device))


UNIFORM_MAX = 1.0 - 2.0**-24  # the largest float32 below 1


def exponential_noise(row_keys: torch.Tensor, salts: torch.Tensor) -> torch.Tensor:
    """q ~ Exponential(1), [S, V] float32: 24 uniform bits per token from the row's key."""
    bits = hash32(salts.unsqueeze(0) ^ row_keys.unsqueeze(1)) >> 8
    uniform = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    # (2^24 - 0.5) / 2^24 rounds to 1.0 in float32: q would be 0 and a token of probability 0
    # (masked by a grammar, top-k, top-p) would win the race as 0 / 0 = NaN. Keep u < 1.
    uniform.clamp_(max=UNIFORM_MAX)
    return uniform.log_().neg_()


# -- penalties ------------------------------------------------------------------------------


def apply_penalties_(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_seen: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """In place on float32 `logits` [P, V], given each row's output-token counts [P, V] and
    prompt-token presence [P, V] (bool) and per-row penalties [P].

    repetition r (HF): for tokens in prompt or output, logit > 0 -> logit / r, else * r.
    frequency f / presence p (OpenAI): logit -= f * count_in_output + p * (count_in_output > 0).
    """
    in_output = counts > 0
    r = repetition.unsqueeze(1)
    seen = prompt_seen | in_output
    logits.copy_(torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits))
    logits.sub_(frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * in_output)
    return logits


def apply_penalties_to_rows_(
    logits: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    prompt_seen: torch.Tensor,
    penalties: torch.Tensor,
) -> None:
    """`apply_penalties_` on rows `rows` of float32 `logits` [R, V], in place: row rows[i] with
    the token counts counts[slots[i]] and prompt tokens prompt_seen[slots[i]] (the
    `TokenCounts` tables) and penalties[i] = (repetition, frequency, presence). On CUDA one
    fused kernel reads the tables' rows where they are; elsewhere the torch version on copies."""
    if _use_triton(logits):
        from common.model.kernels import sampling

        sampling.apply_penalties_(logits, rows, slots, counts, prompt_seen, penalties)
        return
    rep, freq, pres = penalties.unbind(1)
    sub = apply_penalties_(logits[rows], counts[slots], prompt_seen[slots], rep, freq, pres)
    logits.index_copy_(0, rows, sub)


# -- filters --------------------------------------------------------------------------------


def top_k_mask_(logits: torch.Tensor, top_k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Sets logits below each row's k-th largest to -inf (in place). `top_k` [S] int64, a row
    with k <= 0 or k >= V is left alone; `k_max` (host) bounds every active k. Ties with the
    k-th value are kept."""
    vocab = logits.shape[1]
    k_max = max(1, min(k_max, vocab))
    kth = logits.topk(k_max, dim=-1).values
    index = (top_k.clamp(1, k_max) - 1).unsqueeze(1)
    threshold = kth.gather(1, index)
    active = ((top_k > 0) & (top_k < vocab)).unsqueeze(1)
    return logits.masked_fill_(active & (logits < threshold), NEG_INF)


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest probability t such that the tokens strictly more likely than t
    hold less than top_p of the mass; keeping `probs >= t` keeps the nucleus (ties kept
    together, the most likely token always). Exact, with no sort: a fixed-length bisection over
    the bit patterns of non-negative float32 values, which order like the values."""
    bits = probs.view(torch.int32)
    lo = torch.full_like(top_p, -1, dtype=torch.int64)  # predicate false (below every value)
    hi = bits.amax(dim=-1).to(torch.int64)  # predicate true: nothing is above the maximum
    limit = top_p.unsqueeze(1)
    for _ in range(TOP_P_ITERATIONS):
        mid = (lo + hi) // 2
        t = mid.clamp_min(0).to(torch.int32).view(torch.float32).unsqueeze(1)
        mass = torch.where(probs > t, probs, 0.0).sum(dim=-1, keepdim=True)
        keep_above = (mass < limit).squeeze(1) & (hi - lo > 1)
        narrow = (hi - lo > 1) & ~keep_above
        hi = torch.where(keep_above, mid, hi)
        lo = torch.where(narrow, mid, lo)
    return hi.to(torch.int32).view(torch.float32)


def top_p_mask_(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sets tokens outside each row's top-p nucleus to -inf (in place); top_p >= 1 is off."""
    probs = logits.softmax(dim=-1)
    if _use_triton(probs):
        from common.model.kernels import sampling

        threshold = sampling.top_p_threshold(probs, top_p)
    else:
        threshold = top_p_threshold(probs, top_p)
    threshold = torch.where(top_p >= 1.0, torch.zeros_like(threshold), threshold)
    return logits.masked_fill_(probs < threshold.unsqueeze(1), NEG_INF)


def min_p_mask_(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below min_p times the row's largest (in place)."""
    probs = logits.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < floor, NEG_INF)


def filtered_race(
    logits: torch.Tensor,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    row_keys: torch.Tensor,
    salts: torch.Tensor,
) -> torch.Tensor:
    """One token per row from softmax(logits) cut to each row's top-p nucleus, then its min-p
    floor (either None: off). `logits` is consumed. On CUDA one softmax and the fused kernels:
    both cuts become a per-row probability floor for the race, with no masking pass and no
    second softmax (the race and both cuts are unchanged by renormalising)."""
    if not _use_triton(logits):
        if top_p is not None:
            top_p_mask_(logits, top_p)
        if min_p is not None:
            min_p_mask_(logits, min_p)
        return race(logits, row_keys, salts)
    from common.model.kernels import sampling

    probs = logits.softmax(dim=-1)
    peak = probs.amax(dim=-1)
    floor = torch.zeros_like(peak)
    if top_p is not None:
        threshold = sampling.top_p_threshold(probs, top_p, peak)
        floor = torch.where(top_p >= 1.0, floor, threshold)
    if min_p is not None:
        # The nucleus keeps the top token, so its relative floor is the same after the cut.
        floor = torch.maximum(floor, peak * min_p)
    return sampling.race(probs, row_keys, floor)


def race(logits: torch.Tensor, row_keys: torch.Tensor, salts: torch.Tensor) -> torch.Tensor:
    """One token per row drawn from softmax(logits) by the exponential race argmax(p / q),
    q = `exponential_noise(row_keys, salts)`."""
    return race_probs(logits.softmax(dim=-1), row_keys, salts)


def race_probs(probs: torch.Tensor, row_keys: torch.Tensor, salts: torch.Tensor) -> torch.Tensor:
    """`race` on non-negative weights [S, V] float32, contiguous, each row with some positive
    mass; the race is scale-free, so they need not sum to 1. `probs` is consumed."""
    if _use_triton(probs):
        from common.model.kernels import sampling

        return sampling.race(probs, row_keys)
    return probs.div_(exponential_noise(row_keys, salts)).argmax(dim=-1)


# The salt of a token id no vocabulary reaches: lowbias32 is a bijection on 32 bits, so the
# acceptance bits hash an input that no token's race noise hashes under the same row key.
_ACCEPT_SALT = hash32_int(M32)


def acceptance_uniform(row_keys: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per row, [S] float32, from the row key alone and independent of
    the row's race noise: the coin of speculative rejection sampling."""
    bits = hash32(row_keys ^ _ACCEPT_SALT) >> 8
    return ((bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))).clamp_(max=UNIFORM_MAX)


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and _triton_importable()
