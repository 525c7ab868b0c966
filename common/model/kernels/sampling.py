"""Fused sampler kernels (CUDA): the exponential race and the exact top-p threshold, each row
split over several programs so that a few sampled rows still fill the GPU. Every row is computed
alone (its own chunks, a fixed summation and combination order), so a row's result does not
depend on its batch neighbours.

They compute what `common.engine.sampling_ops.race` / `top_p_threshold` compute in torch, from the
same integer hash (bit-identical noise bits); float rounding (log, the order of a sum) may differ
from torch in the last place, so the two paths agree up to exact near-ties. One device always
takes the same path: the prefill and decode nodes on GPUs both run these kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # race: elements per loop iteration of a program
CHUNK = 8192  # elements of a row per program (race and the top-p passes)
MASS_BLOCK = 256  # top-p: elements per loop iteration, times THRESHOLDS accumulators
THRESHOLDS = 16  # top-p: candidate thresholds tried per pass (a 17-way search)
# Passes of the 17-way search that close any interval of float32 bit patterns in [-1, 2^31):
# its width goes 2^31 -> ceil(w / 17) -> ... -> 1 in 8 steps.
TOP_P_PASSES = 8


@triton.jit
def _hash32(x):
    """lowbias32 on uint32 (wrapping multiplies), as `sampling_ops.hash32`."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _race_kernel(
    probs_ptr, keys_ptr, floor_ptr, score_ptr, index_ptr, vocab, stride, chunks,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The best (score, token) of one chunk of one row, over the tokens of probability at least
    the row's floor; `race` picks the best chunk."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    key = tl.load(keys_ptr + row).to(tl.uint32)
    floor = tl.load(floor_ptr + row)
    best_score = -1.0
    best_index = 0
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        p = tl.load(probs_ptr + row.to(tl.int64) * stride + offs, mask=mask, other=0.0)
        bits = _hash32(_hash32(offs.to(tl.uint32)) ^ key) >> 8
        uniform = (bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        uniform = tl.minimum(uniform, 1.0 - 1.0 / 16777216.0)  # 1.0 would make q = 0 (NaN race)
        score = tl.where(mask & (p >= floor), p / -tl.log(uniform), -1.0)
        block_best = tl.max(score, 0)
        block_index = tl.argmax(score, 0)  # the first of equal scores, as torch.argmax
        better = block_best > best_score  # strict: an earlier block wins a tie
        best_index = tl.where(better, start + block_index, best_index)
        best_score = tl.where(better, block_best, best_score)
    tl.store(score_ptr + row * chunks + chunk, best_score)
    tl.store(index_ptr + row * chunks + chunk, best_index.to(tl.int64))


def race(
    probs: torch.Tensor, row_keys: torch.Tensor, floor: torch.Tensor | None = None
) -> torch.Tensor:
    """argmax(probs / q) per row, q ~ Exponential(1) from the row's key; probs [S, V] float32
    (contiguous rows), row_keys [S] int64 in [0, 2^32). Tokens below the row's `floor` ([S]
    float32, a top-p or min-p cut: no need to renormalise, the race is scale-free) never win
    (the top token is always at or above its floor). Returns [S] int64."""
    rows, vocab = probs.shape
    chunks = triton.cdiv(vocab, CHUNK)
    if floor is None:
        floor = torch.zeros(rows, dtype=torch.float32, device=probs.device)
    scores = torch.empty(rows, chunks, dtype=torch.float32, device=probs.device)
    index = torch.empty(rows, chunks, dtype=torch.int64, device=probs.device)
    _race_kernel[(rows, chunks)](
        probs, row_keys, floor.contiguous(), scores, index, vocab, probs.stride(0), chunks,
        CHUNK=CHUNK, BLOCK=BLOCK,
    )  # fmt: skip
    # argmax takes the first of equal scores: an earlier chunk wins a tie, as within a chunk.
    return index.gather(1, scores.argmax(dim=1, keepdim=True)).squeeze(1)


@triton.jit
def _candidates(bounds_ptr, row, K: tl.constexpr):
    """The K thresholds (float32 bit patterns) that split a row's (lo, hi) into K + 1 parts."""
    lo = tl.load(bounds_ptr + 2 * row)
    hi = tl.load(bounds_ptr + 2 * row + 1)
    mids = lo + ((hi - lo) * (tl.arange(0, K) + 1)) // (K + 1)
    return lo, hi, mids


@triton.jit
def _mass_above_kernel(
    probs_ptr, bounds_ptr, partial_ptr, vocab, stride, chunks,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, K: tl.constexpr,
):  # fmt: skip
    """For one chunk of one row: the mass of the probabilities above each candidate threshold."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    _, _, mids = _candidates(bounds_ptr, row, K)
    t = tl.maximum(mids, 0).to(tl.int32).to(tl.float32, bitcast=True)
    acc = tl.zeros((BLOCK, K), dtype=tl.float32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        p = tl.load(probs_ptr + row.to(tl.int64) * stride + offs, mask=offs < vocab, other=0.0)
        acc += tl.where(p[:, None] > t[None, :], p[:, None], 0.0)
    out = partial_ptr + (row * chunks + chunk) * K + tl.arange(0, K)
    tl.store(out, tl.sum(acc, 0))


@triton.jit
def _narrow_kernel(bounds_ptr, partial_ptr, top_p_ptr, chunks, K: tl.constexpr):
    """One row's interval narrowed to the two candidates around its threshold: lo stays below
    it (mass above >= top_p), hi at or above it (mass above < top_p)."""
    row = tl.program_id(0)
    lo, hi, mids = _candidates(bounds_ptr, row, K)
    mass = tl.zeros((K,), dtype=tl.float32)
    for chunk in range(0, chunks):  # a fixed order: the row's sum never depends on the grid
        mass += tl.load(partial_ptr + (row * chunks + chunk) * K + tl.arange(0, K))
    inside = mids > lo  # candidates equal to lo (a closed interval) say nothing new
    above = mass < tl.load(top_p_ptr + row)
    new_hi = tl.min(tl.where(inside & above, mids, hi), 0)
    new_lo = tl.max(tl.where(inside & ~above, mids, lo), 0)
    tl.store(bounds_ptr + 2 * row, new_lo)
    tl.store(bounds_ptr + 2 * row + 1, new_hi)


def top_p_threshold(
    probs: torch.Tensor, top_p: torch.Tensor, peak: torch.Tensor | None = None
) -> torch.Tensor:
    """As `sampling_ops.top_p_threshold`: [S] float32 thresholds, keep `probs >= t`. `peak`:
    each row's largest probability, when the caller has it already.

    The same search over the bit patterns of non-negative floats (they order like the values),
    17-way instead of 2-way: each pass reads the rows once (split over CHUNK-sized programs)
    for 16 candidate thresholds, then keeps the part of the interval that holds the threshold.
    """
    rows, vocab = probs.shape
    chunks = triton.cdiv(vocab, CHUNK)
    if peak is None:
        peak = probs.amax(dim=1)
    peak_bits = peak.view(torch.int32).to(torch.int64)
    bounds = torch.stack([torch.full_like(peak_bits, -1), peak_bits], dim=1).contiguous()
    partial = torch.empty(rows, chunks, THRESHOLDS, dtype=torch.float32, device=probs.device)
    limit = top_p.to(torch.float32).contiguous()
    for _ in range(TOP_P_PASSES):
        _mass_above_kernel[(rows, chunks)](
            probs, bounds, partial, vocab, probs.stride(0), chunks,
            CHUNK=CHUNK, BLOCK=MASS_BLOCK, K=THRESHOLDS,
        )  # fmt: skip
        _narrow_kernel[(rows,)](bounds, partial, limit, chunks, K=THRESHOLDS)
    return bounds[:, 1].to(torch.int32).view(torch.float32)


@triton.jit
def _penalties_kernel(
    logits_ptr, rows_ptr, slots_ptr, counts_ptr, seen_ptr, penalties_ptr, vocab, stride,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One chunk of one penalised row, in place: as `sampling_ops.apply_penalties_`."""
    i, chunk = tl.program_id(0), tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    repetition = tl.load(penalties_ptr + 3 * i)
    frequency = tl.load(penalties_ptr + 3 * i + 1)
    presence = tl.load(penalties_ptr + 3 * i + 2)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        x = tl.load(logits_ptr + row * stride + offs, mask=mask, other=0.0)
        count = tl.load(counts_ptr + slot * vocab + offs, mask=mask, other=0).to(tl.float32)
        in_prompt = tl.load(seen_ptr + slot * vocab + offs, mask=mask, other=0) != 0
        in_output = count > 0
        scaled = tl.where(
            x > 0, tl.math.div_rn(x, repetition), x * repetition
        )  # div_rn: IEEE division, as torch
        x = tl.where(in_prompt | in_output, scaled, x)
        x -= frequency * count + presence * in_output.to(tl.float32)
        tl.store(logits_ptr + row * stride + offs, x, mask=mask)


def apply_penalties_(
    logits: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    prompt_seen: torch.Tensor,
    penalties: torch.Tensor,
) -> None:
    """The repetition, frequency and presence penalties on `logits` rows `rows` (in place, one
    launch): row rows[i] takes the token counts counts[slots[i]] ([*, V] int32), the prompt's
    tokens prompt_seen[slots[i]] ([*, V] bool) and penalties[i] ([P, 3] float32)."""
    vocab = logits.shape[1]
    grid = (rows.shape[0], triton.cdiv(vocab, CHUNK))
    _penalties_kernel[grid](
        logits, rows, slots, counts, prompt_seen.view(torch.uint8), penalties.contiguous(),
        vocab, logits.stride(0), CHUNK=CHUNK, BLOCK=BLOCK, enable_fp_fusion=False,
    )  # fmt: skip
