"""Triton kernels of `fused_moe`: the two grouped GEMMs over a `MoEPlan`'s rows, the row
gather before `torch._grouped_mm` and the per-token sum of the k slots.

Contracts: weights are row-major [E, N, K] (unit stride along K: each weight tile is K-major,
as the MMA wants it), read by per-thread loads or, with TMA (Hopper's tensor memory
accelerator: one thread issues a tile's copy into shared memory), through a descriptor of the
[E * N, K] view; activations have unit stride along their last dim; a program owns
`BLOCK_M` plan rows (one expert: `block_expert`) and `BLOCK_N` output columns; a block owned
by no expert (-1) returns at once. Rows holding no pair (`sorted_pairs` == num_pairs) compute
on token 0 (no masks on the hot loads) and are never read downstream (`pair_rows` skips them).

FP8 (W8A8, FP8 constexpr): the activations come quantized, with float32 scales xs[row, k //
SCALE_GK], and the scale of weight element (n, k) of expert e sits at ws[e, n // SCALE_GN, k //
SCALE_GK]. With block scales (SCALE_GK > 0) each K tile lies inside one scale block (the caller
sizes BLOCK_K so): its FP8 product, summed in float32 by the tensor cores, is scaled by its
row's and its column's scale before it joins the accumulator. With one scale per row
(SCALE_GK 0: per-token activations, per-channel weights) the products accumulate as they come
and the scales apply once, at the end. Either way the tensor cores' reduced-precision FP8 sum is
promoted to float32 every PROMOTE_K columns.
"""

from __future__ import annotations

import triton
import triton.language as tl

from common.model.kernels.loads import load_k
from common.model.kernels.pdl import pdl_prologue


@triton.jit
def _tile(pid, blocks_m, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column tile) of program `pid`: GROUP_M row blocks per column sweep."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(blocks_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


def weight_scale_strides(scale) -> tuple[int, int, int]:
    """(expert, row, K block) strides of a [E, rows, KB] weight scale (or of the weights
    standing in, never read); one scale column has K stride 0."""
    return scale.stride(0), scale.stride(1), scale.stride(2) if scale.shape[2] > 1 else 0


def act_scale_strides(scale) -> tuple[int, int]:
    """(row, K block) strides of a [rows, KB] activation scale; one column: K stride 0."""
    return scale.stride(0), scale.stride(1) if scale.shape[1] > 1 else 0


PROMOTE_K = 128  # as `fp8_gemm_kernels.TileConfig.promote_k`: Hopper keeps ~14 bits there


def promote_k(block_k: int) -> int:
    """The PROMOTE constexpr of a launch: columns summed in FP8 precision per float32 add."""
    return min(block_k, PROMOTE_K)


@triton.jit
def _fp8_step(acc, a, b, a_scales, b_scales, k0, stride_ak, stride_bk, SCALE_GK: tl.constexpr,
              PROMOTE: tl.constexpr):  # fmt: skip
    """acc plus a [M, K] . b[N, K]^T of FP8 tiles: with block scales (SCALE_GK > 0) the fresh
    product times a's and b's scales of the tile's K block, else accumulated unscaled."""
    if SCALE_GK > 0:
        kb = k0 // SCALE_GK
        sa = tl.load(a_scales + kb * stride_ak)
        sb = tl.load(b_scales + kb * stride_bk)
        product = tl.dot(a, tl.trans(b), max_num_imprecise_acc=PROMOTE)
        acc += product * (sa[:, None] * sb[None, :])
    else:
        acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=PROMOTE)
    return acc


@triton.jit
def _row_scales(acc, a_scales, b_scales, SCALE_GK: tl.constexpr):
    """acc times a's and b's one scale per row, when the scales are per row."""
    if SCALE_GK == 0:
        acc = acc * (tl.load(a_scales)[:, None] * tl.load(b_scales)[None, :])
    return acc


@triton.jit
def _filled_rows(sorted_ptr, first, num_pairs, BLOCK_M: tl.constexpr):
    """Rows of the block at `first` that hold a pair: its first ones (an expert's rows hold its
    pairs, then its padding)."""
    pairs = tl.load(sorted_ptr + first + tl.arange(0, BLOCK_M))
    return tl.sum((pairs < num_pairs).to(tl.int32))


@triton.jit
def gate_up_kernel(
    x_ptr, w_ptr, w_desc, xs_ptr, ws_ptr, sorted_ptr, block_expert_ptr, h_ptr,
    num_pairs, blocks_m, N, K, stride_xm, stride_we, stride_wn,
    stride_xsm, stride_xsk, stride_se, stride_sn, stride_sk, stride_hm,
    TOP_K: tl.constexpr, EVEN_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, SCALE_GN: tl.constexpr, SCALE_GK: tl.constexpr, PROMOTE: tl.constexpr,
    TAIL_M: tl.constexpr = 0, TMA: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    """h[row, n] = silu(x[tok] . w[e, n]) * (x[tok] . w[e, N + n]) for N = I: the gate column
    and its up column in one program (two accumulators), so SiLU-and-mul is the epilogue. With
    TAIL_M, a block holding at most TAIL_M pairs (an expert's last) computes and writes only its
    first TAIL_M rows, or its first TAIL_M / 2 if it holds no more (TAIL_M >= 32)."""
    pdl_prologue(PDL)
    pid_m, pid_n = _tile(tl.program_id(0), blocks_m, N, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    first = pid_m * BLOCK_M
    # The tile height is a constexpr: one call per height the block may take.
    if TAIL_M > 0:
        filled = _filled_rows(sorted_ptr, first, num_pairs, BLOCK_M)
        if TAIL_M >= 32:
            if filled <= TAIL_M // 2:
                _gate_up_rows(
                    x_ptr, w_ptr, w_desc, xs_ptr, ws_ptr, sorted_ptr, h_ptr, first, expert, pid_n,
                    num_pairs, N, K, stride_xm, stride_we, stride_wn, stride_xsm, stride_xsk,
                    stride_se, stride_sn, stride_sk, stride_hm, TOP_K, EVEN_K, PRECISION,
                    TAIL_M // 2, BLOCK_N, BLOCK_K, FP8, SCALE_GN, SCALE_GK, PROMOTE, TMA,
                )  # fmt: skip
                return
        if filled <= TAIL_M:
            _gate_up_rows(
                x_ptr, w_ptr, w_desc, xs_ptr, ws_ptr, sorted_ptr, h_ptr, first, expert, pid_n,
                num_pairs, N, K, stride_xm, stride_we, stride_wn, stride_xsm, stride_xsk,
                stride_se, stride_sn, stride_sk, stride_hm, TOP_K, EVEN_K, PRECISION, TAIL_M,
                BLOCK_N, BLOCK_K, FP8, SCALE_GN, SCALE_GK, PROMOTE, TMA,
            )  # fmt: skip
            return
    _gate_up_rows(
        x_ptr, w_ptr, w_desc, xs_ptr, ws_ptr, sorted_ptr, h_ptr, first, expert, pid_n, num_pairs,
        N, K, stride_xm, stride_we, stride_wn, stride_xsm, stride_xsk, stride_se, stride_sn,
        stride_sk, stride_hm, TOP_K, EVEN_K, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, FP8, SCALE_GN,
        SCALE_GK, PROMOTE, TMA,
    )  # fmt: skip


@triton.jit
def _gate_up_rows(
    x_ptr, w_ptr, w_desc, xs_ptr, ws_ptr, sorted_ptr, h_ptr, first, expert, pid_n, num_pairs, N,
    K, stride_xm, stride_we, stride_wn, stride_xsm, stride_xsk, stride_se, stride_sn, stride_sk,
    stride_hm, TOP_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
    SCALE_GN: tl.constexpr, SCALE_GK: tl.constexpr, PROMOTE: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """`gate_up_kernel`'s tile: rows [first, first + ROWS), columns of tile `pid_n`."""
    rows = first + tl.arange(0, ROWS)
    pairs = tl.load(sorted_ptr + rows)
    tokens = tl.where(pairs < num_pairs, pairs // TOP_K, 0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_in = tl.where(rn < N, rn, 0)
    a_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_xm
    gate_rows = w_ptr + expert.to(tl.int64) * stride_we + rn_in.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + N * stride_wn
    gate_row = expert * 2 * N + pid_n * BLOCK_N  # in the [E * 2N, K] view TMA reads
    a_scales = xs_ptr + tokens.to(tl.int64) * stride_xsm
    w_scales = ws_ptr + expert.to(tl.int64) * stride_se
    gate_scales = w_scales + (rn_in // SCALE_GN) * stride_sn
    up_scales = w_scales + ((rn_in + N) // SCALE_GN) * stride_sn
    rk = tl.arange(0, BLOCK_K)
    gate = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        a = load_k(a_rows, ks, K, EVEN_K)
        if TMA:
            g = w_desc.load([gate_row, k0])
            u = w_desc.load([gate_row + N, k0])
        else:
            g = load_k(gate_rows, ks, K, EVEN_K)
            u = load_k(up_rows, ks, K, EVEN_K)
        if FP8:
            gate = _fp8_step(gate, a, g, a_scales, gate_scales, k0, stride_xsk, stride_sk, SCALE_GK, PROMOTE)  # fmt: skip
            up = _fp8_step(up, a, u, a_scales, up_scales, k0, stride_xsk, stride_sk, SCALE_GK, PROMOTE)  # fmt: skip
        else:
            gate = tl.dot(a, tl.trans(g), gate, input_precision=PRECISION)
            up = tl.dot(a, tl.trans(u), up, input_precision=PRECISION)
    if FP8:
        gate = _row_scales(gate, a_scales, gate_scales, SCALE_GK)
        up = _row_scales(up, a_scales, up_scales, SCALE_GK)
    h = gate / (1.0 + tl.exp(-gate)) * up
    out = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + rn[None, :]
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=rn[None, :] < N)


@triton.jit
def down_kernel(
    h_ptr, h_desc, w_ptr, w_desc, hs_ptr, ws_ptr, sorted_ptr, block_expert_ptr, weights_ptr,
    y_ptr, num_pairs, blocks_m, N, K, stride_hm, stride_we, stride_wn,
    stride_hsm, stride_hsk, stride_se, stride_sn, stride_sk, stride_ym,
    TOP_K: tl.constexpr, EVEN_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, SCALE_GN: tl.constexpr, SCALE_GK: tl.constexpr, PROMOTE: tl.constexpr,
    TAIL_M: tl.constexpr = 0, TMA: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    """y[row, n] = routing weight of the row's pair * (h[row] . w[e, n]), N = H; rows holding
    no pair get 0. TAIL_M as in `gate_up_kernel` (the same blocks take it, so only rows that
    gate_up wrote are read)."""
    pdl_prologue(PDL)
    pid_m, pid_n = _tile(tl.program_id(0), blocks_m, N, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    first = pid_m * BLOCK_M
    # The tile height is a constexpr: one call per height the block may take.
    if TAIL_M > 0:
        filled = _filled_rows(sorted_ptr, first, num_pairs, BLOCK_M)
        if TAIL_M >= 32:
            if filled <= TAIL_M // 2:
                _down_rows(
                    h_ptr, h_desc, w_ptr, w_desc, hs_ptr, ws_ptr, sorted_ptr, weights_ptr, y_ptr,
                    first, expert, pid_n, num_pairs, N, K, stride_hm, stride_we, stride_wn,
                    stride_hsm, stride_hsk, stride_se, stride_sn, stride_sk, stride_ym, EVEN_K,
                    PRECISION, TAIL_M // 2, BLOCK_N, BLOCK_K, FP8, SCALE_GN, SCALE_GK, PROMOTE,
                    TMA, False,
                )  # fmt: skip
                return
        if filled <= TAIL_M:
            _down_rows(
                h_ptr, h_desc, w_ptr, w_desc, hs_ptr, ws_ptr, sorted_ptr, weights_ptr, y_ptr,
                first, expert, pid_n, num_pairs, N, K, stride_hm, stride_we, stride_wn,
                stride_hsm, stride_hsk, stride_se, stride_sn, stride_sk, stride_ym, EVEN_K,
                PRECISION, TAIL_M, BLOCK_N, BLOCK_K, FP8, SCALE_GN, SCALE_GK, PROMOTE, TMA, False,
            )  # fmt: skip
            return
    _down_rows(
        h_ptr, h_desc, w_ptr, w_desc, hs_ptr, ws_ptr, sorted_ptr, weights_ptr, y_ptr, first,
        expert, pid_n, num_pairs, N, K, stride_hm, stride_we, stride_wn, stride_hsm, stride_hsk,
        stride_se, stride_sn, stride_sk, stride_ym, EVEN_K, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        FP8, SCALE_GN, SCALE_GK, PROMOTE, TMA, TMA,
    )  # fmt: skip


@triton.jit
def _down_rows(
    h_ptr, h_desc, w_ptr, w_desc, hs_ptr, ws_ptr, sorted_ptr, weights_ptr, y_ptr, first, expert,
    pid_n, num_pairs, N, K, stride_hm, stride_we, stride_wn, stride_hsm, stride_hsk, stride_se,
    stride_sn, stride_sk, stride_ym, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
    SCALE_GN: tl.constexpr, SCALE_GK: tl.constexpr, PROMOTE: tl.constexpr, TMA: tl.constexpr,
    ROWS_TMA: tl.constexpr,
):  # fmt: skip
    """`down_kernel`'s tile: rows [first, first + ROWS), columns of tile `pid_n`; with TMA
    the weight tiles come through `w_desc`, and with ROWS_TMA (a whole block) the rows of h
    through `h_desc`."""
    rows = first + tl.arange(0, ROWS)
    pairs = tl.load(sorted_ptr + rows)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_in = tl.where(rn < N, rn, 0)
    a_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_hm
    b_rows = w_ptr + expert.to(tl.int64) * stride_we + rn_in.to(tl.int64)[:, None] * stride_wn
    a_scales = hs_ptr + rows.to(tl.int64) * stride_hsm
    b_scales = ws_ptr + expert.to(tl.int64) * stride_se + (rn_in // SCALE_GN) * stride_sn
    b_row = expert * N + pid_n * BLOCK_N  # in the [E * N, K] view TMA reads
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        if ROWS_TMA:
            a = h_desc.load([first, k0])
        else:
            a = load_k(a_rows, ks, K, EVEN_K)
        if TMA:
            b = w_desc.load([b_row, k0])
        else:
            b = load_k(b_rows, ks, K, EVEN_K)
        if FP8:
            acc = _fp8_step(acc, a, b, a_scales, b_scales, k0, stride_hsk, stride_sk, SCALE_GK, PROMOTE)  # fmt: skip
        else:
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    if FP8:
        acc = _row_scales(acc, a_scales, b_scales, SCALE_GK)
    weight = tl.load(weights_ptr + pairs, mask=pairs < num_pairs, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=rn[None, :] < N)


@triton.jit
def gather_rows_kernel(x_ptr, sorted_ptr, out_ptr, num_pairs, N, stride_xm, stride_om,
                       TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """out[row] = x[token of the row's pair], zeros for a row holding no pair."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pair = tl.load(sorted_ptr + row)
    token = tl.where(pair < num_pairs, pair // TOP_K, 0).to(tl.int64)
    width = tl.where(pair < num_pairs, N, 0)  # (a scalar & a vector mask trips the interpreter)
    value = tl.load(x_ptr + token * stride_xm + cols, mask=cols < width, other=0.0)
    tl.store(out_ptr + row * stride_om + cols, value, mask=cols < N)


@triton.jit
def sum_slots_kernel(y_ptr, pair_rows_ptr, weights_ptr, out_ptr, N, stride_ym, stride_om,
                     TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """out[t] = sum over j = 0..k-1, in order, of y[pair_rows[t, j]] (times weights[t, j]),
    float32 accumulation; a dropped pair (row -1) adds nothing."""
    pdl_prologue(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(pair_rows_ptr + token * TOP_K + j).to(tl.int64)
        width = tl.where(row >= 0, N, 0)
        value = tl.load(y_ptr + tl.maximum(row, 0) * stride_ym + cols, mask=cols < width, other=0.0)
        value = value.to(tl.float32)
        if HAS_WEIGHTS:
            value = value * tl.load(weights_ptr + token * TOP_K + j).to(tl.float32)
        acc += value
    tl.store(out_ptr + token * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < N)
