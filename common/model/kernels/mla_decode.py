"""Paged decode for DeepSeek's multi-head latent attention (MLA), absorbed form, in Triton.
Cache layout, tiling, softmax, precision and FP8 are `mla_attention`'s (see its docstring); each
split runs its tile loop, `_mla_attend`.

Split-K flash decoding into `paged_attention.DecodeScratch` partials (its layout, with
head_dim = Dc) and a reduce over all splits at once, a column slice per program. Each call's
tiles are an `MLADecodeConfig` (`mla_decode_config`: all of a rank's heads in one program up to
64, the most whose BLOCK_H x Dc fp32 accumulator fits the registers; see `DECODE_CONFIGS`);
with `out_split` 2 the two programs of a head group each compute the full scores but
accumulate P c for half of the Dc output columns.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from common.model.kernels.mla_attention import _check_q, _is_pow2, _load_q, _mla_attend, _strides
from common.model.kernels.paged_attention import (
    LOG2E,
    MAX_DECODE_SPLITS,
    DecodeScratch,
    _num_sms,
)

# Splits per (sequence, head group): enough programs for DECODE_WAVES waves on the SMs, each
# split at least MIN_KEYS_PER_DECODE_SPLIT keys. The first H200 run (16 heads a program,
# docs/bench/mla_h200_decode_run1.json) was fastest at ~2 waves from 32 sequences up, and at 32
# to 64 keys per split for one sequence (1k keys: 11.8 us at 32 splits, 15.6 at the 8 that 128
# keys allowed); past that the partials' writes and the reduce cost more than they spread.
DECODE_WAVES = 2
MIN_KEYS_PER_DECODE_SPLIT = 64
# A reduce program holds at most this many fp32 partial values (splits x columns).
REDUCE_TILE = 4096


@dataclasses.dataclass(frozen=True)
class MLADecodeConfig:
    """Tiles of one decode launch. Every config computes the same result; they differ in
    speed and in whether the kernel fits the SM (shared memory is checked at compile time,
    registers spill silently)."""

    block_h: int  # heads per program (rows of the Q tile): 16, 32, 64 or 128
    block_n: int  # keys per tile: a power of two >= 16
    num_warps: int
    num_stages: int
    out_split: int = 1  # programs per head group, each accumulating Dc / out_split columns


# By BLOCK_H, for 2- and 1-byte caches (bf16, FP8). Registers bound the tile: the fp32
# accumulator is BLOCK_H x Dc / out_split values, and 64 x 512 (128 a thread over 8 warps) is the
# most that fits beside the rest, so 128 heads (V3 at TP 1) run as two groups of 64 whose
# programs are grid neighbours and meet on each key tile in L2. Shared memory (227 KB a program
# on H100/H200) holds q for the wgmma (64 x 576 bf16 = 72 KB) and two key tiles of BLOCK_N x 576
# (the block-table indirection keeps Triton at double buffering whatever num_stages). Triton
# lays the score dot, which feeds the P c dot, with all warps along M, so with 8 warps on 64
# rows both warpgroups compute the same scores: 2 x 576 + 512 MACs a key and head, the same
# 1.5x as out_split 2 (each column program computes all scores). Below 64 rows the dots are
# mma.sync, each warp holding q's rows in registers, so 32 heads take 8 warps. Offline sm_90a
# compile (Triton 3.9): 16/32/4w 196 registers, 55 KB shared; 32/32/8w 172, 74 KB; 64/32/8w 255
# with ~100 B spilled, 144 KB; 128/16/8w/out_split 2, 186, 180 KB. 16 heads ran at the bytes
# floor from 32 sequences of 8k keys in the first H200 run; the rest is not yet measured
# (`bench_mla_decode.py --sweep-configs`).
# From `bench_mla_decode.py --sweep-configs` on one H200 (bf16, 1k and 8k contexts, batch 1 /
# 32 / 128): 64-key tiles won at 16 heads (8k, batch 128: 324 us against 384 for 32-key tiles)
# and at 128 heads (1200 against 1710); 32 heads was not measured.
DECODE_CONFIGS: dict[int, MLADecodeConfig] = {
    16: MLADecodeConfig(16, 64, 4, 3),
    32: MLADecodeConfig(32, 32, 8, 2),
    64: MLADecodeConfig(64, 64, 8, 2),
}
# fp32 caches (tests, reference runs): 16 heads and 16 keys, the tiles that fit shared memory.
FP32_DECODE_CONFIG = MLADecodeConfig(16, 16, 4, 2)


# fmt: off
@triton.jit
def _decode_kernel(
    q_c_ptr, q_r_ptr, cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, seq_lens_ptr,
    block_tables_ptr, scale_log2, kv_scale, num_heads, stride_qct, stride_qch, stride_qrt,
    stride_qrh, stride_ot, stride_oh, stride_cb, stride_cs, stride_bt,
    BLOCK_H: tl.constexpr, PAGE_SIZE: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr,
    BLOCK_N: tl.constexpr, OUT_SPLIT: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # fmt: on
    """Grid (head_groups * OUT_SPLIT, num_seqs, num_splits): a head group's programs, and the
    groups of one sequence, are launched side by side so their reads of a key tile meet in L2.
    The sequence length comes from device memory.

    Split s covers keys [s * per_split, (s + 1) * per_split) clipped to seq_len, per_split a
    multiple of BLOCK_N, so only the last nonempty split has a partial (masked) tile. One
    split stores the normalised output; several store partial rows `[seq, head, split]`
    (m and l by the group's first column program).
    """
    DV: tl.constexpr = DC // OUT_SPLIT
    col = tl.program_id(0) % OUT_SPLIT
    head = tl.program_id(0) // OUT_SPLIT * BLOCK_H + tl.arange(0, BLOCK_H)
    seq64 = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    row_mask = head < num_heads
    seq_len = tl.load(seq_lens_ptr + seq64)
    per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits) * BLOCK_N
    kv_start = tl.minimum(split * per_split, seq_len)
    kv_end = tl.minimum(kv_start + per_split, seq_len)
    full_end = kv_start + (kv_end - kv_start) // BLOCK_N * BLOCK_N

    offs_v = col * DV + tl.arange(0, DV)
    offs_o = (1 - col) * DV + tl.arange(0, DV)  # the other half: read only with OUT_SPLIT 2
    q_v = _load_q(q_c_ptr, seq64, head, row_mask, stride_qct, stride_qch, offs_v, cache_ptr,
                  KV_FP8)  # fmt: skip
    q_o = q_v
    if OUT_SPLIT == 2:
        q_o = _load_q(q_c_ptr, seq64, head, row_mask, stride_qct, stride_qch, offs_o, cache_ptr,
                      KV_FP8)  # fmt: skip
    q_r = _load_q(q_r_ptr, seq64, head, row_mask, stride_qrt, stride_qrh, tl.arange(0, DR),
                  cache_ptr, KV_FP8)  # fmt: skip
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV], tl.float32)
    q_pos = seq_len - 1 + tl.zeros([BLOCK_H], tl.int32)
    table_ptr = block_tables_ptr + seq64 * stride_bt
    acc, m_i, l_i = _mla_attend(
        acc, m_i, l_i, q_v, q_o, q_r, q_pos, kv_start, full_end, offs_v, offs_o, cache_ptr,
        table_ptr, stride_cb, stride_cs, scale_log2, PAGE_SIZE, DC, DR, BLOCK_N, OUT_SPLIT,
        False, KV_FP8,
    )  # fmt: skip
    acc, m_i, l_i = _mla_attend(
        acc, m_i, l_i, q_v, q_o, q_r, q_pos, full_end, kv_end, offs_v, offs_o, cache_ptr,
        table_ptr, stride_cb, stride_cs, scale_log2, PAGE_SIZE, DC, DR, BLOCK_N, OUT_SPLIT,
        True, KV_FP8,
    )  # fmt: skip
    if KV_FP8:  # the reduce is linear in acc, so partial rows may carry kv_scale too
        acc = acc * kv_scale
    if SINGLE_SPLIT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + (seq64 * stride_ot + head * stride_oh)[:, None] + offs_v[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None],
        )
    else:
        part = (seq64 * num_heads + head) * num_splits + split
        # m and l from the first column program; the other's sum the scores' halves in the
        # other order, so they differ from these by rounding only.
        if col == 0:
            tl.store(part_m_ptr + part, m_i, mask=row_mask)
            tl.store(part_l_ptr + part, l_i, mask=row_mask)
        tl.store(part_acc_ptr + part[:, None] * DC + offs_v[None, :], acc, mask=row_mask[:, None])


@triton.jit
def _decode_reduce_kernel(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, stride_ot, stride_oh,
                          num_splits, SPLITS_P2: tl.constexpr, DC: tl.constexpr,
                          BLOCK_C: tl.constexpr):  # fmt: skip
    """Grid (num_seqs, num_heads, Dc / BLOCK_C): columns BLOCK_C of one head's output, every
    split's partial rescaled to the global max and added; all splits are loaded at once, so a
    program waits for one round of loads, not one per split."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    parts = (seq * tl.num_programs(1) + head) * num_splits + tl.arange(0, SPLITS_P2)
    in_range = tl.arange(0, SPLITS_P2) < num_splits
    m = tl.load(part_m_ptr + parts, mask=in_range, other=float("-inf"))
    l_s = tl.load(part_l_ptr + parts, mask=in_range, other=0.0)
    acc = tl.load(part_acc_ptr + parts[:, None] * DC + offs_c[None, :], mask=in_range[:, None],
                  other=0.0)  # fmt: skip
    m_max = tl.max(m, 0)
    # Empty splits (m = -inf, l = 0, acc = 0) weigh 0; all empty (seq_len 0): the output is 0.
    w = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    denom = tl.sum(l_s * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    out_row = out_ptr + seq * stride_ot + head * stride_oh
    tl.store(out_row + offs_c, out.to(out_ptr.dtype.element_ty))


def mla_decode_config(
    num_heads: int, cache_dtype: torch.dtype = torch.bfloat16
) -> MLADecodeConfig:
    """The `DECODE_CONFIGS` entry with the most heads up to max(16, next_pow2(num_heads)): all
    of a rank's heads in one program up to 64, groups of 64 beyond; an fp32 cache takes
    `FP32_DECODE_CONFIG`."""
    if cache_dtype.itemsize == 4:
        return FP32_DECODE_CONFIG
    want = max(16, triton.next_power_of_2(num_heads))
    return DECODE_CONFIGS[max(h for h in DECODE_CONFIGS if h <= want)]


def _check_config(config: MLADecodeConfig, dc: int) -> None:
    tiles_ok = _is_pow2(config.block_h) and _is_pow2(config.block_n)
    launch_ok = config.num_warps in (1, 2, 4, 8, 16) and config.num_stages >= 1
    if not (tiles_ok and launch_ok and config.out_split in (1, 2) and dc // config.out_split >= 16):
        raise ValueError(f"bad MLA decode config {config} for Dc={dc}: block_h and block_n "
                         f"powers of two >= 16, out_split 1 or 2, num_warps a power of two "
                         f"<= 16, num_stages >= 1")  # fmt: skip


def mla_decode_splits(
    num_seqs: int,
    num_heads: int,
    device: torch.device,
    max_seq_len: int | None = None,
    *,
    config: MLADecodeConfig | None = None,
) -> int:
    """Splits per (sequence, head group), from static values only (CUDA-graph safe): enough
    programs for DECODE_WAVES waves on the device's SMs, a power of two <= MAX_DECODE_SPLITS.
    With `max_seq_len` (an upper bound, fixed for a captured graph) a split also keeps at least
    MIN_KEYS_PER_DECODE_SPLIT keys. `config` defaults to `mla_decode_config(num_heads)`."""
    config = config or mla_decode_config(num_heads)
    programs = max(1, num_seqs * triton.cdiv(num_heads, config.block_h) * config.out_split)
    limit = min(triton.cdiv(DECODE_WAVES * _num_sms(device), programs), MAX_DECODE_SPLITS)
    if max_seq_len is not None:
        limit = min(limit, triton.cdiv(max(max_seq_len, 1), MIN_KEYS_PER_DECODE_SPLIT))
    limit = max(1, limit)
    return 1 << (limit.bit_length() - 1)


def mla_decode_scratch(
    num_seqs: int,
    num_heads: int,
    kv_lora_rank: int,
    device: torch.device,
    max_seq_len: int | None = None,
    *,
    config: MLADecodeConfig | None = None,
) -> DecodeScratch:
    """Partials for `paged_mla_decode` with `mla_decode_splits` splits. A caller that captures
    CUDA graphs allocates this before capture and keeps it as long as the graphs."""
    splits = mla_decode_splits(num_seqs, num_heads, device, max_seq_len, config=config)
    return DecodeScratch.allocate(num_seqs, num_heads, splits, kv_lora_rank, device)


def paged_mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_scale: float = 1.0,
    out: torch.Tensor | None = None,
    *,
    scratch: DecodeScratch | None = None,
    config: MLADecodeConfig | None = None,
) -> torch.Tensor:
    """Row i (q_nope [B, H, Dc], q_pe [B, H, Dr]) attends to the first `seq_lens[i]` cache rows
    of `block_tables[i]` (its own token included); returns out [B, H, Dc] in q's dtype.

    Host values come from shapes and the fixed scales only, so this is CUDA-graph capturable;
    lengths are read on the device and a row of length 0 gets zeros. The split count is
    `scratch`'s (`mla_decode_scratch`; one split needs none); without one, `mla_decode_scratch`
    is allocated for this call. `config` (tiles; default `mla_decode_config(H, cache.dtype)`)
    is the tuning sweep's and the tests' way in."""
    kv_fp8 = _check_q(q_nope, q_pe, cache, kv_scale)
    num_seqs, num_heads, dc = q_nope.shape
    config = config or mla_decode_config(num_heads, cache.dtype)
    _check_config(config, dc)
    if seq_lens.shape[0] < num_seqs or block_tables.shape[0] < num_seqs:
        raise ValueError(f"{num_seqs} query rows but seq_lens {tuple(seq_lens.shape)}, "
                         f"block_tables {tuple(block_tables.shape)}")  # fmt: skip
    if out is None:
        out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
    elif out.shape != q_nope.shape or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} strides {out.stride()} does not fit q_nope "
                         f"{tuple(q_nope.shape)}")  # fmt: skip
    if num_seqs == 0:
        return out
    if scratch is None:
        scratch = mla_decode_scratch(num_seqs, num_heads, dc, q_nope.device, config=config)
    part_shape = tuple(scratch.acc.shape)
    if part_shape[:2] != (num_seqs, num_heads) or part_shape[3] != dc:
        raise ValueError(f"scratch {part_shape} does not fit q_nope {tuple(q_nope.shape)}")
    num_splits = part_shape[2]
    scale_log2 = scale * LOG2E * (kv_scale if kv_fp8 else 1.0)
    parts = (scratch.max_log2, scratch.sum_exp, scratch.acc)
    grid = (triton.cdiv(num_heads, config.block_h) * config.out_split, num_seqs, num_splits)
    _decode_kernel[grid](
        q_nope, q_pe, cache, out, *parts, seq_lens, block_tables, scale_log2, kv_scale, num_heads,
        *_strides(q_nope, q_pe, out, cache, block_tables), BLOCK_H=config.block_h,
        PAGE_SIZE=cache.shape[1], DC=dc, DR=q_pe.shape[2], BLOCK_N=config.block_n,
        OUT_SPLIT=config.out_split, SINGLE_SPLIT=num_splits == 1, KV_FP8=kv_fp8,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        splits_p2 = triton.next_power_of_2(num_splits)
        block_c = min(dc, max(16, REDUCE_TILE // splits_p2))
        _decode_reduce_kernel[(num_seqs, num_heads, dc // block_c)](
            out, *parts, out.stride(0), out.stride(1), num_splits, SPLITS_P2=splits_p2, DC=dc,
            BLOCK_C=block_c, num_warps=4,
        )  # fmt: skip
    return out
