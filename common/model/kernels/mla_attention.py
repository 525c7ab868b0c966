"""Paged attention for DeepSeek's multi-head latent attention (MLA), absorbed form, in Triton.

Cache: one layer's pool `[num_blocks + 1, page_size, 1, Dc + Dr]` (the last block is the padding
block), one row per token: the compressed latent c (Dc = kv_lora_rank) then the rotary key k_pe
(Dr = qk_rope_head_dim). Query head h brings q_nope[h] (Dc values, W_UK folded in) and q_pe[h]
(Dr values, rotated); key n scores `scale * (q_nope . c_n + q_pe . kpe_n)` and the output is
`sum_n p_n c_n` (Dc values; the model applies W_UV after). So this is MQA with a Dc + Dr key,
a value equal to the key's first Dc columns, and all H heads on the one KV head.

Tiling: the heads fill the rows of the Q tile (row r is head `group * BLOCK_H + r % BLOCK_H`,
in prefill token `r // BLOCK_H` of the tile), so each key tile is loaded once per head group
and all products are `tl.dot`: scores are `[M, Dc] x [Dc, N] + [M, Dr] x [Dr, N]` (latent and
rope are two loads and two dots, nothing padded to 1024) and the output `[M, N] x [N, Dc]`
reuses the latent tile just loaded. Dc and Dr must be powers of two (512 and 64 in every
DeepSeek model), which keeps the column masks out of the hot loop.

Softmax, precision and FP8 follow `paged_attention` (see its docstring): base-2 online softmax,
fp32 accumulation, fp32 inputs at ieee precision. A float8_e4m3fn cache holds
`clamp(x / kv_scale, -448, 448)` rounded to nearest even (`write_latent`); tiles are widened to
q's dtype in registers, kv_scale joins the softmax scale and multiplies the accumulator once
(keys and values are the same numbers, so one scale).

Decode is split-K flash decoding into `paged_attention.DecodeScratch` partials (its layout, with
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

from common.model.kernels.fused_ops import _quantize_e4m3
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


@triton.jit
def _load_keys(cache_ptr, rows, offs, n_mask, MASKED: tl.constexpr):
    """Columns `offs` of the cache rows `rows`; rows past n_mask read 0 when MASKED."""
    if MASKED:
        return tl.load(cache_ptr + rows[:, None] + offs[None, :], mask=n_mask[:, None], other=0.0)
    return tl.load(cache_ptr + rows[:, None] + offs[None, :])


# fmt: off
@triton.jit
def _mla_attend(
    acc, m_i, l_i, q_v, q_o, q_r, q_pos, kv_start, kv_end, offs_v, offs_o, cache_ptr, table_ptr,
    stride_cb, stride_cs, scale_log2,
    PAGE_SIZE: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr,
    OUT_SPLIT: tl.constexpr, MASKED: tl.constexpr, KV_FP8: tl.constexpr,
):
    # fmt: on
    """Online softmax of the tile's rows over keys [kv_start, kv_end), continuing (acc, m_i,
    l_i) as `paged_attention._attend` does. acc holds latent columns `offs_v` (q_v is q's
    part for them); with OUT_SPLIT 2 the scores also take the other half, `offs_o` and q_o.
    With MASKED, row r sees key n iff n <= q_pos[r] and n < kv_end; without, the caller
    promises every key of every tile is visible."""
    offs_r = DC + tl.arange(0, DR)
    for start in range(kv_start, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        if MASKED:
            pages = tl.load(table_ptr + offs_n // PAGE_SIZE, mask=n_mask, other=0)
        else:
            pages = tl.load(table_ptr + offs_n // PAGE_SIZE)
        rows = pages.to(tl.int64) * stride_cb + (offs_n % PAGE_SIZE) * stride_cs
        c = _load_keys(cache_ptr, rows, offs_v, n_mask, MASKED).to(q_v.dtype)
        k_r = _load_keys(cache_ptr, rows, offs_r, n_mask, MASKED).to(q_v.dtype)
        s = tl.dot(q_v, tl.trans(c), input_precision="ieee")
        if OUT_SPLIT == 2:
            c_o = _load_keys(cache_ptr, rows, offs_o, n_mask, MASKED).to(q_v.dtype)
            s = tl.dot(q_o, tl.trans(c_o), s, input_precision="ieee")
        s = tl.dot(q_r, tl.trans(k_r), s, input_precision="ieee") * scale_log2
        if MASKED:
            visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen no key keeps m = -inf; shifting by 0 gives exp2 = 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_shift = m_new
        alpha = tl.math.exp2(m_i - m_shift)
        p = tl.math.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision="ieee")
        m_i = m_new
    return acc, m_i, l_i


# fmt: off
@triton.jit
def _load_q(q_ptr, tok64, head, row_mask, stride_qt, stride_qh, offs, cache_ptr,
            KV_FP8: tl.constexpr):
    # fmt: on
    """Rows (tok64, head) of q at columns `offs`, in the cache's dtype (an FP8 cache's tiles
    are widened to q's instead)."""
    q = tl.load(
        q_ptr + (tok64 * stride_qt + head * stride_qh)[:, None] + offs[None, :],
        mask=row_mask[:, None],
        other=0.0,
    )
    if not KV_FP8:
        q = q.to(cache_ptr.dtype.element_ty)
    return q


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


# fmt: off
@triton.jit
def _prefill_kernel(
    q_c_ptr, q_r_ptr, cache_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    scale_log2, kv_scale, num_heads, stride_qct, stride_qch, stride_qrt, stride_qrh, stride_ot,
    stride_oh, stride_cb, stride_cs, stride_bt,
    BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, PAGE_SIZE: tl.constexpr, DC: tl.constexpr,
    DR: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr,
):
    # fmt: on
    """Grid (cdiv(max_query_len, BLOCK_Q), head_groups, num_seqs): BLOCK_Q tokens x BLOCK_H
    heads per program."""
    # Causal: later query tiles see more keys; launching them first lets short ones fill the tail.
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq) - q_len  # keys before this chunk

    offs_m = tl.arange(0, BLOCK_Q * BLOCK_H)
    tok = q_block * BLOCK_Q + offs_m // BLOCK_H
    head = tl.program_id(1) * BLOCK_H + offs_m % BLOCK_H
    row_mask = (tok < q_len) & (head < num_heads)
    tok64 = (q_start + tok).to(tl.int64)
    offs_c = tl.arange(0, DC)
    q_c = _load_q(q_c_ptr, tok64, head, row_mask, stride_qct, stride_qch, offs_c, cache_ptr,
                  KV_FP8)  # fmt: skip
    q_r = _load_q(q_r_ptr, tok64, head, row_mask, stride_qrt, stride_qrh, tl.arange(0, DR),
                  cache_ptr, KV_FP8)  # fmt: skip
    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, DC], tl.float32)
    q_pos = ctx_len + tok
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Whole key tiles up to the tile's first token are visible to all its rows and run
    # unmasked; the rest, up to its last token, is the masked causal diagonal.
    unmasked_end = (ctx_len + q_block * BLOCK_Q + 1) // BLOCK_N * BLOCK_N
    kv_end = ctx_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    acc, m_i, l_i = _mla_attend(
        acc, m_i, l_i, q_c, q_c, q_r, q_pos, 0, unmasked_end, offs_c, offs_c, cache_ptr,
        table_ptr, stride_cb, stride_cs, scale_log2, PAGE_SIZE, DC, DR, BLOCK_N, 1, False, KV_FP8,
    )  # fmt: skip
    acc, m_i, l_i = _mla_attend(
        acc, m_i, l_i, q_c, q_c, q_r, q_pos, unmasked_end, kv_end, offs_c, offs_c, cache_ptr,
        table_ptr, stride_cb, stride_cs, scale_log2, PAGE_SIZE, DC, DR, BLOCK_N, 1, True, KV_FP8,
    )  # fmt: skip
    if KV_FP8:
        acc = acc * kv_scale
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + (tok64 * stride_ot + head * stride_oh)[:, None] + offs_c[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None],
    )


# fmt: off
@triton.jit
def _write_latent_kernel(
    latent_ptr, k_pe_ptr, cache_ptr, slots_ptr, kv_scale, stride_lt, stride_rt, stride_cb,
    stride_cs, PAGE_SIZE: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr, KV_FP8: tl.constexpr,
):
    # fmt: on
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    dst = cache_ptr + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs
    offs_c = tl.arange(0, DC)
    offs_r = tl.arange(0, DR)
    c = tl.load(latent_ptr + tok * stride_lt + offs_c)
    k_r = tl.load(k_pe_ptr + tok * stride_rt + offs_r)
    if KV_FP8:
        c = _quantize_e4m3(c.to(tl.float32), kv_scale)
        k_r = _quantize_e4m3(k_r.to(tl.float32), kv_scale)
    tl.store(dst + offs_c, c.to(cache_ptr.dtype.element_ty))
    tl.store(dst + DC + offs_r, k_r.to(cache_ptr.dtype.element_ty))


def _is_pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _check_cache(cache: torch.Tensor, dc: int, dr: int, kv_scale: float) -> bool:
    """Validates the cache against the latent widths; returns whether it is FP8."""
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != dc + dr or cache.stride(3) != 1:
        raise ValueError(
            f"MLA cache must be [blocks, page_size, 1, {dc} + {dr}] with the last dim "
            f"contiguous; got shape {tuple(cache.shape)} strides {cache.stride()}"
        )
    if not (_is_pow2(dc) and _is_pow2(dr)):
        raise ValueError(f"MLA widths must be powers of two >= 16, got Dc={dc}, Dr={dr}")
    if cache.dtype != torch.float8_e4m3fn:
        return False
    if not kv_scale > 0:
        raise ValueError(f"FP8 MLA cache needs a positive kv_scale, got {kv_scale}")
    return True


def _check_q(
    q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, kv_scale: float
) -> bool:
    shapes_ok = q_nope.dim() == q_pe.dim() == 3 and q_nope.shape[:2] == q_pe.shape[:2]
    if not shapes_ok or q_nope.stride(2) != 1 or q_pe.stride(2) != 1 or q_nope.dtype != q_pe.dtype:
        raise ValueError(
            f"q_nope and q_pe must be [tokens, heads, D] of one dtype with D contiguous; got "
            f"{tuple(q_nope.shape)} {q_nope.dtype} strides {q_nope.stride()} and "
            f"{tuple(q_pe.shape)} {q_pe.dtype} strides {q_pe.stride()}"
        )
    return _check_cache(cache, q_nope.shape[2], q_pe.shape[2], kv_scale)


def _strides(q_nope, q_pe, out, cache, block_tables) -> tuple[int, ...]:
    return (q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0),
            out.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0))  # fmt: skip


def _block_n(cache: torch.Tensor) -> int:
    """Keys per tile: 32 rows of 576 bf16 (or FP8) values, 16 of fp32 (shared memory)."""
    return 16 if cache.element_size() == 4 else 32


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


def paged_mla_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    kv_scale: float = 1.0,
    *,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context; returns
    [T, H, Dc] in q's dtype.

    Sequence i's tokens `query_start_loc[i]:query_start_loc[i + 1]` are the last of its
    `seq_lens[i]` keys, all already in the cache: its cached prefix is fully visible, the new
    tokens causally. Rows outside `query_start_loc[0]:query_start_loc[-1]` are not written.
    `max_query_len` (host) bounds the grid. `block_n` overrides the key tile (tests)."""
    kv_fp8 = _check_q(q_nope, q_pe, cache, kv_scale)
    num_heads, dc = q_nope.shape[1], q_nope.shape[2]
    out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs <= 0 or max_query_len <= 0:
        return out
    if seq_lens.shape[0] < num_seqs or block_tables.shape[0] < num_seqs:
        raise ValueError(f"{num_seqs} sequences but seq_lens {tuple(seq_lens.shape)}, "
                         f"block_tables {tuple(block_tables.shape)}")  # fmt: skip
    # Tile rows = BLOCK_Q tokens x BLOCK_H heads, at most 64 (a 64 x 512 fp32 accumulator over
    # 8 warps; 32 for fp32 operands, whose tiles would overflow shared memory), fewer for short
    # chunks.
    block_h = min(16, triton.next_power_of_2(num_heads))
    max_rows = 32 if cache.element_size() == 4 else 64
    rows = max(16, min(max_rows, triton.next_power_of_2(max_query_len * block_h)))
    block_q = rows // block_h
    grid = (triton.cdiv(max_query_len, block_q), triton.cdiv(num_heads, block_h), num_seqs)
    scale_log2 = scale * LOG2E * (kv_scale if kv_fp8 else 1.0)
    _prefill_kernel[grid](
        q_nope, q_pe, cache, out, query_start_loc, seq_lens, block_tables, scale_log2, kv_scale,
        num_heads, *_strides(q_nope, q_pe, out, cache, block_tables), BLOCK_H=block_h,
        BLOCK_Q=block_q, PAGE_SIZE=cache.shape[1], DC=dc, DR=q_pe.shape[2],
        BLOCK_N=block_n or _block_n(cache), KV_FP8=kv_fp8, num_warps=8 if rows > 32 else 4,
        num_stages=2,
    )  # fmt: skip
    return out


def write_latent(
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float = 1.0,
) -> None:
    """Store rows latent [T, Dc] and k_pe [T, Dr] at `slot_mapping` ([T], `block * page_size +
    offset`; tokens with a slot < 0 are skipped on the device) in the cache's dtype. A
    float8_e4m3fn cache gets `clamp(x / kv_scale, -448, 448)` rounded to nearest even
    (`fp8_ops.quantize`, bit for bit); other caches a plain cast, kv_scale ignored."""
    if (
        latent.dim() != 2
        or k_pe.dim() != 2
        or latent.shape[0] != k_pe.shape[0]
        or slot_mapping.shape != (latent.shape[0],)
    ):
        raise ValueError(f"write_latent: latent {tuple(latent.shape)}, k_pe {tuple(k_pe.shape)}, "
                         f"slots {tuple(slot_mapping.shape)}")  # fmt: skip
    kv_fp8 = _check_cache(cache, latent.shape[1], k_pe.shape[1], kv_scale)
    if latent.stride(1) != 1 or k_pe.stride(1) != 1:
        latent, k_pe = latent.contiguous(), k_pe.contiguous()
    if latent.shape[0] == 0:
        return
    _write_latent_kernel[(latent.shape[0],)](
        latent, k_pe, cache, slot_mapping, kv_scale, latent.stride(0), k_pe.stride(0),
        cache.stride(0), cache.stride(1), PAGE_SIZE=cache.shape[1], DC=latent.shape[1],
        DR=k_pe.shape[1], KV_FP8=kv_fp8, num_warps=4,
    )  # fmt: skip
