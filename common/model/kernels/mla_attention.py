"""Paged attention for DeepSeek's multi-head latent attention (MLA), absorbed form, in Triton:
the tile loop both paths share, causal prefill (`paged_mla_prefill`) and the latent write
(`write_latent`); decode is `mla_decode`.

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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.model.kernels.fused_ops import _quantize_e4m3
from common.model.kernels.paged_attention import LOG2E


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


def _block_n(cache: torch.Tensor, q_dtype: torch.dtype) -> int:
    """Keys per tile, as many as shared memory holds beside the q tile (227 KB a program on
    H100/H200). 64 rows of 576 values for a 16-bit q over a 16-bit or FP8 cache: on an H200
    22-30% faster than 32 (bf16 and FP8 caches, 512 to 8192 new tokens, none or 4096 cached;
    `docs/bench/mla_h200_prefill_tiles.json`); 128 overflows. An fp32 q over an FP8 cache
    keeps 32, an fp32 cache 16."""
    if cache.element_size() == 4:
        return 16
    return 32 if q_dtype.itemsize == 4 else 64


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
    tile = block_n or _block_n(cache, q_nope.dtype)
    _prefill_kernel[grid](
        q_nope, q_pe, cache, out, query_start_loc, seq_lens, block_tables, scale_log2, kv_scale,
        num_heads, *_strides(q_nope, q_pe, out, cache, block_tables), BLOCK_H=block_h,
        BLOCK_Q=block_q, PAGE_SIZE=cache.shape[1], DC=dc, DR=q_pe.shape[2],
        BLOCK_N=tile, KV_FP8=kv_fp8, num_warps=8 if rows > 32 else 4,
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
