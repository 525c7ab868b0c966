"""Triton kernels of `fused_moe`: the two grouped GEMMs over a `MoEPlan`'s rows, the row
gather before `torch._grouped_mm` and the per-token sum of the k slots.

Contracts: weights are row-major [E, N, K] (unit stride along K: each weight tile is K-major,
as the MMA wants it); activations have unit stride along their last dim; a program owns
`BLOCK_M` plan rows (one expert: `block_expert`) and `BLOCK_N` output columns; a block owned
by no expert (-1) returns at once. Rows holding no pair (`sorted_pairs` == num_pairs) compute
on token 0 (no masks on the hot loads) and are never read downstream (`pair_rows` skips them).
"""

from __future__ import annotations

import triton
import triton.language as tl

from common.model.kernels.pdl import pdl_prologue


@triton.jit
def _tile(pid, blocks_m, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column tile) of program `pid`: GROUP_M row blocks per column sweep."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(blocks_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def _load_k(ptrs, ks, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        tile = tl.load(ptrs + ks[None, :])
    else:
        tile = tl.load(ptrs + ks[None, :], mask=ks[None, :] < K, other=0.0)
    return tile


@triton.jit
def gate_up_kernel(
    x_ptr, w_ptr, sorted_ptr, block_expert_ptr, h_ptr,
    num_pairs, blocks_m, N, K, stride_xm, stride_we, stride_wn, stride_hm,
    TOP_K: tl.constexpr, EVEN_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """h[row, n] = silu(x[tok] . w[e, n]) * (x[tok] . w[e, N + n]) for N = I: the gate column
    and its up column in one program (two accumulators), so SiLU-and-mul is the epilogue."""
    pdl_prologue(PDL)
    pid_m, pid_n = _tile(tl.program_id(0), blocks_m, N, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)
    tokens = tl.where(pairs < num_pairs, pairs // TOP_K, 0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_in = tl.where(rn < N, rn, 0)
    a_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_xm
    gate_rows = w_ptr + expert.to(tl.int64) * stride_we + rn_in.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + N * stride_wn
    rk = tl.arange(0, BLOCK_K)
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        a = _load_k(a_rows, ks, K, EVEN_K)
        gate = tl.dot(a, tl.trans(_load_k(gate_rows, ks, K, EVEN_K)), gate, input_precision=PRECISION)  # fmt: skip
        up = tl.dot(a, tl.trans(_load_k(up_rows, ks, K, EVEN_K)), up, input_precision=PRECISION)  # fmt: skip
    h = gate / (1.0 + tl.exp(-gate)) * up
    out = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + rn[None, :]
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=rn[None, :] < N)


@triton.jit
def down_kernel(
    h_ptr, w_ptr, sorted_ptr, block_expert_ptr, weights_ptr, y_ptr,
    num_pairs, blocks_m, N, K, stride_hm, stride_we, stride_wn, stride_ym,
    TOP_K: tl.constexpr, EVEN_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """y[row, n] = routing weight of the row's pair * (h[row] . w[e, n]), N = H; rows holding
    no pair get 0."""
    pdl_prologue(PDL)
    pid_m, pid_n = _tile(tl.program_id(0), blocks_m, N, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_in = tl.where(rn < N, rn, 0)
    a_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_hm
    b_rows = w_ptr + expert.to(tl.int64) * stride_we + rn_in.to(tl.int64)[:, None] * stride_wn
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        a = _load_k(a_rows, ks, K, EVEN_K)
        acc = tl.dot(a, tl.trans(_load_k(b_rows, ks, K, EVEN_K)), acc, input_precision=PRECISION)  # fmt: skip
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
