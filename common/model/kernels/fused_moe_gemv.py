"""The expert computation at a few tokens (decode), as GEMVs: no routing plan, no row padding,
no tl.dot, and each token's k slots summed inside GEMM2, so two launches in all.

- `gate_up_gemv_kernel`: program (column tile, pair p = t * k + j) computes
  h[p] = silu(x[t] . w13[e, n]) * (x[t] . w13[e, I + n]) for its BLOCK_N columns, e = ids[p];
  pairs sharing a column tile are neighbours in the grid, so pairs of one expert read its
  tile while it is in L2.
- `down_gemv_kernel`: program (column tile, token t) computes
  out[t, n] = sum over j = 0..k-1, in order, of weights[t, j] * (h[t * k + j] . w2[e, n]),
  one float32 accumulator over the slots' K steps taken as one loop (so loads run ahead across
  slots), rounded once: deterministic, no atomics.
An id outside [0, E) drops its pair: GEMM1 skips it, GEMM2's masked loads read nothing for it.

FP8 experts (W8A8, `fused_moe_gemv_fp8` below): the same two launches over FP8 x and h with their
scales. A weight tile is [BLOCK_N, G, TILE_K], G runs of TILE_K columns inside one scale block
each: a run's products of FP8 values are summed in float32, then scaled by the activation's and
the weight's scales of its block.

Every weight tile is [BLOCK_N, BLOCK_K] with K contiguous (wide coalesced loads) and summed
over K only after the loop (one [BLOCK_N, BLOCK_K] float32 accumulator per output).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from common.model.kernels.fused_moe_kernels import act_scale_strides, weight_scale_strides


@dataclasses.dataclass(frozen=True)
class GemvTiles:
    block_n: int  # output columns per program
    block_k: int
    num_warps: int
    num_stages: int  # software pipelining depth of the K loop


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    gate_up: GemvTiles
    down: GemvTiles
    fill_sms: bool = True  # halve block_n (down to MIN_BLOCK_N) while programs < SMs


MIN_BLOCK_N = 4
# Unmeasured first guess, sized by bytes in flight: an H200 wants ~4 MB in flight to stream at
# its copy rate. GEMM1 at one token: ~3 programs per SM, 2 x 16 KB tiles ahead each; GEMM2 has
# one program per column tile (~2 per SM at one token), hence deeper K steps, 3 x 8 KB ahead.
GEMV_CONFIG = GemvConfig(GemvTiles(16, 256, 4, 3), GemvTiles(16, 512, 4, 4))


def narrowed(config: GemvConfig, pairs: int, tokens: int, inter: int, hidden: int,
             sms: int) -> GemvConfig:  # fmt: skip
    """`config` with each GEMM's block_n halved while its programs leave SMs idle."""
    if not config.fill_sms:
        return config

    def fill(tiles: GemvTiles, rows: int, n: int) -> GemvTiles:
        block_n = tiles.block_n
        while block_n > MIN_BLOCK_N and rows * triton.cdiv(n, block_n) < sms:
            block_n //= 2
        return dataclasses.replace(tiles, block_n=block_n)

    return GemvConfig(fill(config.gate_up, pairs, inter), fill(config.down, tokens, hidden))


def fused_moe_gemv(x, w13, w2, topk_weights, topk_ids, config: GemvConfig, out) -> None:
    """`out` [T, H] of checked 16-bit operands (`fused_moe._check`) through the two GEMV
    kernels."""
    tokens, hidden = x.shape
    num_experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    pairs = tokens * top_k
    ids = topk_ids.contiguous()
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    t1, t2 = config.gate_up, config.down
    # Launched without PDL: early-launched programs land unevenly over the SMs (`pdl.py`).
    gate_up_gemv_kernel[(pairs * triton.cdiv(inter, t1.block_n),)](
        x, w13, ids, h, pairs, num_experts, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, EVEN_K=hidden % t1.block_k == 0, BLOCK_N=t1.block_n, BLOCK_K=t1.block_k,
        NUM_STAGES=t1.num_stages, num_warps=t1.num_warps,
    )  # fmt: skip
    down_gemv_kernel[(tokens * triton.cdiv(hidden, t2.block_n),)](
        h, w2, ids, topk_weights.contiguous(), out, tokens, num_experts, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_N=t2.block_n, BLOCK_K=t2.block_k, NUM_STAGES=t2.num_stages,
        num_warps=t2.num_warps,
    )  # fmt: skip


@triton.jit
def gate_up_gemv_kernel(
    x_ptr, w_ptr, ids_ptr, h_ptr, num_pairs, E, N, K,
    stride_xm, stride_we, stride_wn, stride_hm,
    TOP_K: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pair, tile_n = pid % num_pairs, pid // num_pairs
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if (expert < 0) | (expert >= E):
        return
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_in = tl.where(rn < N, rn, 0)
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm
    gate_rows = w_ptr + expert * stride_we + rn_in.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + N * stride_wn
    rk = tl.arange(0, BLOCK_K)
    gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + rk
        if EVEN_K:
            a = tl.load(x_row + ks)
            g = tl.load(gate_rows + ks[None, :])
            u = tl.load(up_rows + ks[None, :])
        else:
            a = tl.load(x_row + ks, mask=ks < K, other=0.0)
            g = tl.load(gate_rows + ks[None, :], mask=ks[None, :] < K, other=0.0)
            u = tl.load(up_rows + ks[None, :], mask=ks[None, :] < K, other=0.0)
        a = a.to(tl.float32)[None, :]
        gate += g.to(tl.float32) * a
        up += u.to(tl.float32) * a
    g = tl.sum(gate, axis=1)
    h = g / (1.0 + tl.exp(-g)) * tl.sum(up, axis=1)
    tl.store(h_ptr + pair.to(tl.int64) * stride_hm + rn, h.to(h_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def down_gemv_kernel(
    h_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, num_tokens, E, N, K,
    stride_hm, stride_we, stride_wn, stride_om,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    token, tile_n = pid % num_tokens, pid // num_tokens
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_in = tl.where(rn < N, rn, 0)
    rk = tl.arange(0, BLOCK_K)
    steps = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for i in tl.range(0, TOP_K * steps, num_stages=NUM_STAGES):
        pair = token.to(tl.int64) * TOP_K + i // steps
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        routed = (expert >= 0) & (expert < E)
        ks = (i % steps) * BLOCK_K + rk
        k_in = ks < tl.where(routed, K, 0)  # (a scalar & a vector mask trips the interpreter)
        a = tl.load(h_ptr + pair * stride_hm + ks, mask=k_in, other=0.0).to(tl.float32)
        a = a * tl.load(weights_ptr + pair, mask=routed, other=0.0).to(tl.float32)
        rows = (
            w_ptr
            + tl.where(routed, expert, 0) * stride_we
            + rn_in.to(tl.int64)[:, None] * stride_wn
        )
        w = tl.load(rows + ks[None, :], mask=k_in[None, :], other=0.0)
        acc += w.to(tl.float32) * a[None, :]
    out = tl.sum(acc, axis=1)
    dst = out_ptr + token.to(tl.int64) * stride_om + rn
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=rn < N)


def fused_moe_gemv_fp8(xa, w13, w2, scales, topk_weights, topk_ids, config: GemvConfig, out,
                       quantize) -> None:  # fmt: skip
    """`out` [T, H] of FP8 experts: `xa` the tokens as an `Fp8Activation` (scales [T, KB] or
    [T, 1]), `scales` the weights' `ExpertScales`; `quantize` turns h into the same layout
    (`ops.quantize_fp8` with the scales' activation layout). config's block_k must be a
    multiple of the scale block along K, or divide it."""
    tokens, hidden = xa.data.shape
    num_experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, topk_ids.shape[1]
    pairs = tokens * top_k
    ids = topk_ids.contiguous()
    h = torch.empty(pairs, inter, dtype=out.dtype, device=out.device)
    t1, t2 = config.gate_up, config.down
    group = scales.group_k

    def tile_k(block_k: int) -> int:  # columns of one scale run within a K step
        return min(block_k, group) if group else block_k

    gate_up_gemv_fp8_kernel[(pairs * triton.cdiv(inter, t1.block_n),)](
        xa.data, w13, xa.scale, scales.w13, ids, h, pairs, num_experts, inter, hidden,
        xa.data.stride(0), w13.stride(0), w13.stride(1), *act_scale_strides(xa.scale),
        *weight_scale_strides(scales.w13), h.stride(0),
        TOP_K=top_k, BLOCK_N=t1.block_n, BLOCK_K=t1.block_k, TILE_K=tile_k(t1.block_k),
        SCALE_GN=scales.group_n, SCALE_GK=group or t1.block_k, NUM_STAGES=t1.num_stages,
        num_warps=t1.num_warps,
    )  # fmt: skip
    ha = quantize(h)
    down_gemv_fp8_kernel[(tokens * triton.cdiv(hidden, t2.block_n),)](
        ha.data, w2, ha.scale, scales.w2, ids, topk_weights.contiguous(), out, tokens,
        num_experts, hidden, inter, ha.data.stride(0), w2.stride(0), w2.stride(1),
        *act_scale_strides(ha.scale), *weight_scale_strides(scales.w2), out.stride(0),
        TOP_K=top_k, BLOCK_N=t2.block_n, BLOCK_K=t2.block_k, TILE_K=tile_k(t2.block_k),
        SCALE_GN=scales.group_n, SCALE_GK=group or t2.block_k, NUM_STAGES=t2.num_stages,
        num_warps=t2.num_warps,
    )  # fmt: skip


@triton.jit
def _runs(k0, BLOCK_K: tl.constexpr, TILE_K: tl.constexpr):
    """The K offsets of one step as [G, TILE_K] runs, and each run's first column [G]."""
    starts = k0 + tl.arange(0, BLOCK_K // TILE_K) * TILE_K
    return starts[:, None] + tl.arange(0, TILE_K)[None, :], starts


@triton.jit
def gate_up_gemv_fp8_kernel(
    x_ptr, w_ptr, xs_ptr, ws_ptr, ids_ptr, h_ptr, num_pairs, E, N, K,
    stride_xm, stride_we, stride_wn, stride_xsm, stride_xsk, stride_se, stride_sn, stride_sk,
    stride_hm,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_K: tl.constexpr,
    SCALE_GN: tl.constexpr, SCALE_GK: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """`gate_up_gemv_kernel` over FP8 x and weights."""
    pid = tl.program_id(0)
    pair, tile_n = pid % num_pairs, pid // num_pairs
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if (expert < 0) | (expert >= E):
        return
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_in = tl.where(rn < N, rn, 0)
    token = (pair // TOP_K).to(tl.int64)
    x_row, x_scales = x_ptr + token * stride_xm, xs_ptr + token * stride_xsm
    gate_rows = w_ptr + expert * stride_we + rn_in.to(tl.int64)[:, None, None] * stride_wn
    up_rows = gate_rows + N * stride_wn
    w_scales = ws_ptr + expert * stride_se
    gate_scales = w_scales + (rn_in // SCALE_GN)[:, None] * stride_sn
    up_scales = w_scales + ((rn_in + N) // SCALE_GN)[:, None] * stride_sn
    gate = tl.zeros((BLOCK_N, BLOCK_K // TILE_K), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K // TILE_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        ks, starts = _runs(k0, BLOCK_K, TILE_K)
        live = starts < K
        a = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)[None, :, :]
        g = tl.load(gate_rows + ks[None, :, :], mask=ks[None, :, :] < K, other=0.0)
        u = tl.load(up_rows + ks[None, :, :], mask=ks[None, :, :] < K, other=0.0)
        kb = starts // SCALE_GK
        sa = tl.load(x_scales + kb * stride_xsk, mask=live, other=0.0)[None, :]
        sg = tl.load(gate_scales + kb[None, :] * stride_sk, mask=live[None, :], other=0.0)
        su = tl.load(up_scales + kb[None, :] * stride_sk, mask=live[None, :], other=0.0)
        gate += tl.sum(g.to(tl.float32) * a, axis=2) * (sg * sa)
        up += tl.sum(u.to(tl.float32) * a, axis=2) * (su * sa)
    g = tl.sum(gate, axis=1)
    h = g / (1.0 + tl.exp(-g)) * tl.sum(up, axis=1)
    tl.store(h_ptr + pair.to(tl.int64) * stride_hm + rn, h.to(h_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def down_gemv_fp8_kernel(
    h_ptr, w_ptr, hs_ptr, ws_ptr, ids_ptr, weights_ptr, out_ptr, num_tokens, E, N, K,
    stride_hm, stride_we, stride_wn, stride_hsm, stride_hsk, stride_se, stride_sn, stride_sk,
    stride_om,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_K: tl.constexpr,
    SCALE_GN: tl.constexpr, SCALE_GK: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """`down_gemv_kernel` over FP8 h and weights."""
    pid = tl.program_id(0)
    token, tile_n = pid % num_tokens, pid // num_tokens
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_in = tl.where(rn < N, rn, 0)
    steps = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K // TILE_K), dtype=tl.float32)
    for i in tl.range(0, TOP_K * steps, num_stages=NUM_STAGES):
        pair = token.to(tl.int64) * TOP_K + i // steps
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        routed = (expert >= 0) & (expert < E)
        ks, starts = _runs((i % steps) * BLOCK_K, BLOCK_K, TILE_K)
        width = tl.where(routed, K, 0)  # (a scalar & a vector mask trips the interpreter)
        k_in, live = ks < width, starts < width
        a = tl.load(h_ptr + pair * stride_hm + ks, mask=k_in, other=0.0).to(tl.float32)
        kb = starts // SCALE_GK
        sa = tl.load(hs_ptr + pair * stride_hsm + kb * stride_hsk, mask=live, other=0.0)
        sa = sa * tl.load(weights_ptr + pair, mask=routed, other=0.0).to(tl.float32)
        e = tl.where(routed, expert, 0)
        rows = w_ptr + e * stride_we + rn_in.to(tl.int64)[:, None, None] * stride_wn
        w = tl.load(rows + ks[None, :, :], mask=k_in[None, :, :], other=0.0)
        w_scales = ws_ptr + e * stride_se + (rn_in // SCALE_GN)[:, None] * stride_sn
        sw = tl.load(w_scales + kb[None, :] * stride_sk, mask=live[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[None, :, :], axis=2) * (sw * sa[None, :])
    out = tl.sum(acc, axis=1)
    dst = out_ptr + token.to(tl.int64) * stride_om + rn
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=rn < N)
