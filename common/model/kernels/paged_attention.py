"""Paged attention in Triton: varlen causal prefill and split-K flash-decoding.

Both kernels read K/V straight from one layer's pool `[num_blocks, page_size, kv_heads,
head_dim]` (head_dim contiguous) through the block table, one gathered row per key, so any
page size works and BLOCK_N need not equal it; pages are looked up per key as `table[pos //
page_size]` and block ids are widened to int64 before they multiply a stride.

GQA packing: the query heads sharing one KV head fill the rows of the Q tile. Row r of a tile is
query token `r // GROUP` of the tile and head `kv_head * GROUP + r % GROUP`, so each K/V tile is
loaded once per group and both products are tensor-core `tl.dot`s: `[BLOCK_M, D] x [D, BLOCK_N]`
for scores and `[BLOCK_M, BLOCK_N] x [BLOCK_N, D]` for P V. Decode is the one-token case with the
group padded to 16 rows (the smallest dot); grouped decode packs a verify run's rows x GROUP
heads into one tile, so the run's keys are read once (`_decode_kernel`).

Softmax is online (flash-attention) in base 2: scores are scaled by `scale * log2(e)` and
exponentiated with exp2. Accumulation is fp32; P is cast to the cache dtype (FP8: to q's) for P V.
fp32 inputs use `input_precision="ieee"` (no tf32), so fp32 matches the torch reference closely.

FP8 KV: a float8_e4m3fn cache holds `clamp(x / scale, -448, 448)` (round to nearest even; see
`fused_ops.write_kv`) with one scale per layer for K and one for V, and reads as `stored * scale`.
The kernels convert K and V tiles to the products' dtype in registers (exact: every e4m3 value is
a bf16, fp16 and fp32 value) and apply the scales outside the products: `k_scale` joins the
softmax scale, `v_scale` multiplies the fp32 accumulator once. The scales are host floats fixed
for the process, so captured graphs keep them. Non-FP8 caches ignore the scales. With a bf16 q
the products run in fp16, q clamped to fp16's range: Hopper converts two e4m3 values to fp16 in
one instruction (`cvt.rn.f16x2.e4m3x2`) and has none for bf16. On an H200 (`bench_attention.py`,
batch 128, 8k keys, 128-key tiles) that took a decode call from 563 to 462 us; bf16 KV takes
483 us there for twice the bytes, so FP8 decode attention is bound by its per-key work, not by
bytes. fp16 keeps three more mantissa bits than bf16 for q and P; an fp32 q keeps fp32
products.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from common.model.kernels.pdl import pdl_args, pdl_prologue

LOG2E = math.log2(math.e)
# A decode split covers at least this many keys: below it the extra partial writes and the
# reduce cost more than the parallelism gains.
MIN_KEYS_PER_SPLIT = 128
MAX_DECODE_SPLITS = 64
DECODE_STAGES = 3  # pipelined K/V tiles of a decode program (head_dim <= 128)
PREFILL_STAGES = 2  # and of a prefill program


# fmt: off
@triton.jit
def _attend(
    acc, m_i, l_i, q, q_pos, kv_start, kv_end, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
    stride_cb, stride_cs, stride_ch, scale_log2,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, KV_FP8: tl.constexpr,
):
    # fmt: on
    """Online softmax of q's rows over keys [kv_start, kv_end), continuing (acc, m_i, l_i):
    unnormalised P V, running max in log2 units, sum of exp2(score - m_i). A row that saw no
    key keeps (0, -inf, 0). With MASKED, row r sees key n iff n <= q_pos[r] and n < kv_end;
    without, the caller promises every key of every tile is visible (whole tiles below the
    causal diagonal), which drops the masks from the hot loop. With KV_FP8, K and V tiles are
    widened to q's dtype; their scales are the caller's (scale_log2 and the final acc)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    head_off = kv_head.to(tl.int64) * stride_ch
    for start in range(kv_start, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        if MASKED:
            pages = tl.load(table_ptr + offs_n // PAGE_SIZE, mask=n_mask, other=0)
        else:
            pages = tl.load(table_ptr + offs_n // PAGE_SIZE)
        rows = pages.to(tl.int64) * stride_cb + (offs_n % PAGE_SIZE) * stride_cs + head_off
        kv_ptrs = rows[:, None] + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        if MASKED:
            k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        else:
            k = tl.load(k_cache_ptr + kv_ptrs, mask=d_mask[None, :], other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        if MASKED:
            visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen no key yet keeps m = -inf; shifting it by 0 makes exp2
            # give 0 instead of NaN (-inf - -inf).
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_shift = m_new
        alpha = tl.math.exp2(m_i - m_shift)
        p = tl.math.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        else:
            v = tl.load(v_cache_ptr + kv_ptrs, mask=d_mask[None, :], other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _product_q(q, k_cache_ptr, KV_FP8: tl.constexpr, FP16_PRODUCTS: tl.constexpr):
    """q in the dtype of both products; `_attend` widens K and V tiles to it. A bf16 or fp16
    cache: the cache's dtype. FP8: q's own dtype, or with FP16_PRODUCTS fp16, clamped to its
    range (a bf16 q beyond 65504 would become inf)."""
    if not KV_FP8:
        q = q.to(k_cache_ptr.dtype.element_ty)
    elif FP16_PRODUCTS:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


# fmt: off
@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    scale_log2, v_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
    stride_bt, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr, FP16_PRODUCTS: tl.constexpr,
):
    # fmt: on
    """Grid (kv_heads, cdiv(max_query_len, BLOCK_Q), num_seqs): BLOCK_Q tokens x GROUP heads."""
    kv_head = tl.program_id(0)
    # Causal: later query tiles attend to more keys. Launch them first so the short ones fill
    # the tail of the grid instead of leaving SMs idle behind one long tile.
    q_block = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # keys before this chunk: cached prefix and earlier chunks

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = q_block * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    io_mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    tok64 = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + (tok64 * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )
    q = _product_q(q, k_cache_ptr, KV_FP8, FP16_PRODUCTS)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    q_pos = ctx_len + tok
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Keys up to the tile's first token are visible to all its rows: whole tiles of those run
    # unmasked. The rest, up to the tile's last token, is the masked causal diagonal.
    unmasked_end = (ctx_len + q_block * BLOCK_Q + 1) // BLOCK_N * BLOCK_N
    kv_end = ctx_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q, q_pos, 0, unmasked_end, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
        stride_cb, stride_cs, stride_ch, scale_log2, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, False,
        KV_FP8,
    )  # fmt: skip
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q, q_pos, unmasked_end, kv_end, k_cache_ptr, v_cache_ptr, table_ptr,
        kv_head, stride_cb, stride_cs, stride_ch, scale_log2, PAGE_SIZE, HEAD_DIM, BLOCK_D,
        BLOCK_N, True, KV_FP8,
    )  # fmt: skip
    if KV_FP8:
        acc = acc * v_scale
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + (tok64 * stride_ot + head * stride_oh)[:, None] + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


# fmt: off
@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, seq_lens_ptr,
    block_tables_ptr, groups_ptr, scale_log2, v_scale, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr, KV_FP8: tl.constexpr,
    GROUPED: tl.constexpr, FP16_PRODUCTS: tl.constexpr, PDL: tl.constexpr = False,
):
    # fmt: on
    """Grid (num_rows, kv_heads, num_splits). The sequence length comes from device memory.

    Split s covers keys [s * per_split, (s + 1) * per_split) clipped to seq_len, per_split a
    multiple of BLOCK_N, so the host never needs the lengths (CUDA-graph replay changes them).
    One split writes the normalised output itself; several write partial (m, l, acc) rows
    `[row, head, split]` for `_decode_reduce_kernel`.

    GROUPED: `groups[row]` rows starting at `row` are one run (a verify step's rows of one
    sequence: one block table, lengths growing by one per row); 0 marks the run's other rows,
    whose programs exit. The leader tiles its n rows x GROUP heads (tile row r: run row
    r // GROUP), walks the keys of the run's last (longest) row once, masks each tile row at
    its own row's length and writes every row's output or partials at that row's index.
    """
    pdl_prologue(PDL)  # before the early return: a waiting kernel must not end first
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    seq64 = seq.to(tl.int64)
    if GROUPED:
        n_rows = tl.load(groups_ptr + seq)
        if n_rows == 0:
            return
        run_row = offs_m // GROUP
        head = kv_head * GROUP + offs_m % GROUP
        row_mask = run_row < n_rows
        row64 = seq64 + run_row
        seq_len = tl.load(seq_lens_ptr + seq + n_rows - 1)
        q_pos = tl.load(seq_lens_ptr + seq + run_row, mask=row_mask, other=0) - 1
    else:
        head = kv_head * GROUP + offs_m
        row_mask = offs_m < GROUP
        row64 = seq64
        seq_len = tl.load(seq_lens_ptr + seq)
        q_pos = seq_len - 1 + tl.zeros([BLOCK_M], tl.int32)
    per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits) * BLOCK_N
    kv_start = split * per_split
    kv_end = tl.minimum(kv_start + per_split, seq_len)

    q = tl.load(
        q_ptr + (row64 * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q = _product_q(q, k_cache_ptr, KV_FP8, FP16_PRODUCTS)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_ptr = block_tables_ptr + seq64 * stride_bt
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q, q_pos, kv_start, kv_end, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
        stride_cb, stride_cs, stride_ch, scale_log2, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, True,
        KV_FP8,
    )  # fmt: skip
    if KV_FP8:  # the reduce is linear in acc, so partial rows may carry v_scale too
        acc = acc * v_scale
    if SINGLE_SPLIT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + (row64 * stride_ot + head * stride_oh)[:, None] + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )
    else:
        num_heads = tl.num_programs(1) * GROUP
        part = (row64 * num_heads + head) * num_splits + split  # [BLOCK_M] row index
        tl.store(part_m_ptr + part, m_i, mask=row_mask)
        tl.store(part_l_ptr + part, l_i, mask=row_mask)
        tl.store(
            part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_mask[:, None]
        )


# fmt: off
@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, stride_ot, stride_oh, num_splits,
    SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # fmt: on
    """Grid (num_seqs, num_heads): rescale each split's partial sums to the global max, add."""
    pdl_prologue(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    part = (seq * tl.num_programs(1) + head) * num_splits + offs_s
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    m_max = tl.max(m, 0)
    # All splits empty (seq_len 0): every weight is exp2(-inf) = 0 and the output 0.
    w = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    denom = tl.sum(tl.load(part_l_ptr + part, mask=s_mask, other=0.0) * w, 0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None], other=0.0
    )
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@dataclass(frozen=True)
class DecodeScratch:
    """fp32 partial results of a split decode, `[num_seqs, num_heads, num_splits(, block_d)]`."""

    max_log2: torch.Tensor  # running max of the scaled scores, log2 units
    sum_exp: torch.Tensor  # sum of exp2(score - max_log2)
    acc: torch.Tensor  # unnormalised P V

    @classmethod
    def allocate(
        cls, num_seqs: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
    ) -> DecodeScratch:
        shape = (num_seqs, num_heads, num_splits)
        block_d = triton.next_power_of_2(head_dim)
        return cls(
            max_log2=torch.empty(shape, dtype=torch.float32, device=device),
            sum_exp=torch.empty(shape, dtype=torch.float32, device=device),
            acc=torch.empty((*shape, block_d), dtype=torch.float32, device=device),
        )


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H100 SXM, so interpreted runs choose what a GPU would


def decode_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Splits per (sequence, KV head): enough programs for ~2 waves, >= 128 keys per split.

    A power of two (few compiled variants, few scratch shapes). `max_seq_len` is only an upper
    bound: the kernel splits each sequence's real length, so a smaller one is still correct.
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = triton.cdiv(2 * _num_sms(device), programs)
    by_length = triton.cdiv(max(max_seq_len, 1), MIN_KEYS_PER_SPLIT)
    limit = max(1, min(wanted, by_length, MAX_DECODE_SPLITS))
    return 1 << (limit.bit_length() - 1)


def decode_block_n(
    block_d: int, block_m: int, kv_fp8: bool, programs: int, device: torch.device
) -> int:
    """Keys per tile of a decode program. On an H200 (`bench_attention.py`, 28/4 heads of 128):
    128 keys won for FP8 caches at every batch (b128, 8k keys: 466 us a call against 581 at
    64), and for bf16 while the programs are fewer than two per SM (b1, b32: up to x1.27); with
    more (b128) bf16 lost at 128 (575 against 488 us). Wide heads and multi-row tiles (a verify
    step's grouped rows) keep the smaller tiles: their registers and shared memory are full."""
    if block_d > 128:
        return 32
    if block_m > 16 or not _tiles_fit(device, DECODE_STAGES, 128, block_d, 1 if kv_fp8 else 2):
        return 64
    return 128 if kv_fp8 or programs < 2 * _num_sms(device) else 64


@functools.lru_cache(maxsize=8)
def _shared_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    return 227 * 1024  # an H100 / H200, so interpreted runs choose what a GPU would


def _tiles_fit(device: torch.device, stages: int, block_n: int, block_d: int, itemsize: int) -> bool:
    """Whether `stages` pipelined K and V tiles of block_n keys fit in shared memory, with 16 KB
    left for the rest of the program (GPUs before Hopper have 100-164 KB against its 227)."""
    return stages * 2 * block_n * block_d * itemsize + 16 * 1024 <= _shared_bytes(device)


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError(
            f"K and V caches need equal strides with head_dim contiguous, got "
            f"{k_cache.stride()} and {v_cache.stride()}"
        )
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


def _kv_fp8(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float, v_scale: float) -> bool:
    """Whether the caches are FP8 (then the scales apply and must be positive)."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"K and V caches differ in dtype: {k_cache.dtype} vs {v_cache.dtype}")
    if k_cache.dtype != torch.float8_e4m3fn:
        return False
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"FP8 KV scales must be positive, got k_scale={k_scale}, v_scale={v_scale}")
    return True


def _fp16_products(q: torch.Tensor, kv_fp8: bool, override: bool | None) -> bool:
    """Whether an FP8 cache's products run in fp16: by default when q is bf16 (module
    docstring); fp32 q keeps fp32 products. `override` is for benchmarks and tests."""
    if not kv_fp8:
        return False
    return q.dtype == torch.bfloat16 if override is None else override


def _check_q(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if q.dim() != 3 or q.stride(2) != 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"q must be [tokens, heads, head_dim] with head_dim contiguous and heads a multiple "
            f"of kv_heads={num_kv_heads}; got shape {tuple(q.shape)} strides {q.stride()}"
        )
    return num_heads // num_kv_heads


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    block_n: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp16_products: bool | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_rows: int = 64,
) -> None:
    """Causal attention of each sequence's new tokens over its whole paged context.

    Writes `out` rows `query_start_loc[0]:query_start_loc[-1]`; other rows are left alone.
    The new tokens' K/V must already be in the cache. `block_n` overrides the key tile (tests).
    `k_scale`/`v_scale` dequantize an FP8 cache, `fp16_products` overrides how (module
    docstring). `num_warps`, `num_stages` and `max_rows` (of a tile) override the launch
    (benchmarks).
    """
    group = _check_q(q, k_cache)
    kv_fp8 = _kv_fp8(k_cache, v_cache, k_scale, v_scale)
    fp16 = _fp16_products(q, kv_fp8, fp16_products)
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs == 0 or max_query_len == 0:
        return
    head_dim = q.shape[2]
    block_d = triton.next_power_of_2(head_dim)
    # Tile rows = BLOCK_Q tokens x GROUP heads: 64 (one warpgroup's wgmma; on an H100 64 beat
    # 128 by 5-10%: twice the programs balance the causal work better), fewer when only short
    # chunks or decode rows are queued.
    rows_wanted = min(max_rows, triton.next_power_of_2(max_query_len * group))
    block_m = max(16, triton.next_power_of_2(group), rows_wanted)
    block_q = block_m // group
    # FP8 tiles are half the bytes: 128 keys a tile beat 64 on an H200 at 2k and 8k tokens
    # (`bench_attention.py`); bf16 stays at 64, which beat 128 there.
    num_warps = num_warps or (4 if block_d <= 128 else 8)
    num_stages = num_stages or PREFILL_STAGES
    wide_fp8 = kv_fp8 and _tiles_fit(q.device, num_stages, 128, block_d, 1)
    block_n = block_n or (32 if block_d > 128 else 128 if wide_fp8 else 64)
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1),
               *_cache_strides(k_cache, v_cache), block_tables.stride(0))  # fmt: skip
    grid = (k_cache.shape[2], triton.cdiv(max_query_len, block_q), num_seqs)
    scale_log2 = scale * LOG2E * k_scale if kv_fp8 else scale * LOG2E
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale_log2, v_scale,
        *strides, GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, PAGE_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, KV_FP8=kv_fp8, FP16_PRODUCTS=fp16,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    scratch: DecodeScratch | None,
    block_n: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    groups: torch.Tensor | None = None,
    rows_max: int = 1,
    fp16_products: bool | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> None:
    """One query token per row: row i of q and out attends to the first `seq_lens[i]` keys of
    `block_tables[i]`.

    Every host-side value comes from tensor shapes (and the fixed scales), so this is CUDA-graph
    capturable: the split count is `scratch`'s (1 when None), lengths are read on the device, a
    sequence of length 0 gets a zero row. `block_n` overrides the key tile (tests).
    `k_scale`/`v_scale` dequantize an FP8 cache, `fp16_products` overrides how (module
    docstring). `num_warps`/`num_stages` override the launch (benchmarks).

    `groups` ([>= rows] int32, device) with `rows_max` > 1 reads each run of rows sharing a
    block table once (`_decode_kernel`, GROUPED): `groups[i]` = n in 1..rows_max where a run
    of n rows starts at row i, 0 on its other rows. The caller promises that a run's rows are
    consecutive, inside the batch, share row i's block table and have lengths `seq_lens[i] + j`
    (the kernel reads the table of the run's first row and the keys up to its last row's
    length). Without groups, or with rows_max 1, every row reads its own keys (today's launch).
    """
    if rows_max < 1:
        raise ValueError(f"rows_max must be >= 1, got {rows_max}")
    group = _check_q(q, k_cache)
    kv_fp8 = _kv_fp8(k_cache, v_cache, k_scale, v_scale)
    fp16 = _fp16_products(q, kv_fp8, fp16_products)
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return
    if seq_lens.shape[0] < num_seqs or block_tables.shape[0] < num_seqs:
        raise ValueError(f"{num_seqs} query rows but seq_lens {tuple(seq_lens.shape)}, "
                         f"block_tables {tuple(block_tables.shape)}")  # fmt: skip
    grouped = groups is not None and rows_max > 1
    if grouped and (groups.dtype != torch.int32 or groups.shape[0] < num_seqs):
        raise ValueError(f"groups must be int32 with >= {num_seqs} rows, got {groups.dtype} "
                         f"{tuple(groups.shape)}")  # fmt: skip
    num_splits = 1 if scratch is None else scratch.max_log2.shape[2]
    if scratch is not None and tuple(scratch.max_log2.shape[:2]) != (num_seqs, num_heads):
        raise ValueError(f"scratch {tuple(scratch.max_log2.shape)} does not fit q {tuple(q.shape)}")
    block_d = triton.next_power_of_2(head_dim)
    # A run's rows x GROUP heads share one tile (16 rows at least: the smallest dot).
    block_m = max(16, triton.next_power_of_2(group * (rows_max if grouped else 1)))
    programs = num_seqs * k_cache.shape[2] * num_splits
    block_n = block_n or decode_block_n(block_d, block_m, kv_fp8, programs, q.device)
    num_warps = num_warps or 4
    num_stages = num_stages or (DECODE_STAGES if block_d <= 128 else 2)
    parts = (out, out, out) if scratch is None else (scratch.max_log2, scratch.sum_exp, scratch.acc)
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1),
               *_cache_strides(k_cache, v_cache), block_tables.stride(0))  # fmt: skip
    scale_log2 = scale * LOG2E * k_scale if kv_fp8 else scale * LOG2E
    _decode_kernel[(num_seqs, k_cache.shape[2], num_splits)](
        q, k_cache, v_cache, out, *parts, seq_lens, block_tables, groups if grouped else seq_lens,
        scale_log2, v_scale, *strides, GROUP=group, BLOCK_M=block_m, PAGE_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, SINGLE_SPLIT=num_splits == 1,
        KV_FP8=kv_fp8, GROUPED=grouped, FP16_PRODUCTS=fp16, num_warps=num_warps,
        num_stages=num_stages, **pdl_args(q.device),
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, *parts, out.stride(0), out.stride(1), num_splits,
            SPLITS_P2=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, BLOCK_D=block_d,
            num_warps=4, **pdl_args(q.device),
        )  # fmt: skip
