"""Fused sampler kernels (CUDA): the exponential race and the exact top-p threshold, one program
per row, one launch for every row. Each row is computed alone (its own loop over the
vocabulary, fixed summation order), so a row's result does not depend on its batch neighbours.

They compute what `common.sampling_ops.race` / `top_p_threshold` compute in torch, from the
same integer hash (bit-identical noise bits); float rounding (log, the order of a sum) may differ
from torch in the last place, so the two paths agree up to exact near-ties. One device always
takes the same path: the prefill and decode nodes on GPUs both run these kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
TOP_P_ITERATIONS = 31


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
def _race_kernel(probs_ptr, keys_ptr, out_ptr, vocab, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    key = tl.load(keys_ptr + row).to(tl.uint32)
    best_score = -1.0
    best_index = 0
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        p = tl.load(probs_ptr + row.to(tl.int64) * stride + offs, mask=mask, other=0.0)
        bits = _hash32(_hash32(offs.to(tl.uint32)) ^ key) >> 8
        uniform = (bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        uniform = tl.minimum(uniform, 1.0 - 1.0 / 16777216.0)  # 1.0 would make q = 0 (NaN race)
        score = tl.where(mask, p / -tl.log(uniform), -1.0)
        block_best = tl.max(score, 0)
        block_index = tl.argmax(score, 0)  # the first of equal scores, as torch.argmax
        better = block_best > best_score  # strict: an earlier block wins a tie
        best_index = tl.where(better, start + block_index, best_index)
        best_score = tl.where(better, block_best, best_score)
    tl.store(out_ptr + row, best_index)


def race(probs: torch.Tensor, row_keys: torch.Tensor) -> torch.Tensor:
    """argmax(probs / q) per row, q ~ Exponential(1) from the row's key; probs [S, V] float32
    (contiguous rows), row_keys [S] int64 in [0, 2^32). Returns [S] int64."""
    rows, vocab = probs.shape
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    _race_kernel[(rows,)](probs, row_keys, out, vocab, probs.stride(0), BLOCK=BLOCK)
    return out


@triton.jit
def _row_mass_above(probs_ptr, row, stride, vocab, t, BLOCK: tl.constexpr):
    mass = 0.0
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        p = tl.load(probs_ptr + row.to(tl.int64) * stride + offs, mask=offs < vocab, other=0.0)
        mass += tl.sum(tl.where(p > t, p, 0.0), 0)
    return mass


@triton.jit
def _top_p_kernel(
    probs_ptr, top_p_ptr, out_ptr, vocab, stride, BLOCK: tl.constexpr, ITERATIONS: tl.constexpr
):
    row = tl.program_id(0)
    top_p = tl.load(top_p_ptr + row)
    peak = 0.0
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        p = tl.load(probs_ptr + row.to(tl.int64) * stride + offs, mask=offs < vocab, other=0.0)
        peak = tl.maximum(peak, tl.max(p, 0))
    # Bisection over the bit patterns of non-negative floats (they order like the values):
    # lo is below the threshold, hi at or above it.
    lo = tl.full((), -1, tl.int64)
    hi = peak.to(tl.int32, bitcast=True).to(tl.int64)
    for _ in range(ITERATIONS):
        mid = (lo + hi) >> 1  # floor, also for lo = -1
        t = tl.maximum(mid, 0).to(tl.int32).to(tl.float32, bitcast=True)
        mass = _row_mass_above(probs_ptr, row, stride, vocab, t, BLOCK)
        open_ = hi - lo > 1
        above = open_ & (mass < top_p)
        hi = tl.where(above, mid, hi)
        lo = tl.where(open_ & ~above, mid, lo)
    tl.store(out_ptr + row, hi.to(tl.int32).to(tl.float32, bitcast=True))


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """As `sampling_ops.top_p_threshold`: [S] float32 thresholds, keep `probs >= t`."""
    rows, vocab = probs.shape
    out = torch.empty(rows, dtype=torch.float32, device=probs.device)
    _top_p_kernel[(rows,)](
        probs,
        top_p.to(torch.float32).contiguous(),
        out,
        vocab,
        probs.stride(0),
        BLOCK=BLOCK,
        ITERATIONS=TOP_P_ITERATIONS,
    )
    return out
