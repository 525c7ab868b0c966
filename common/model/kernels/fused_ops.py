"""Fused elementwise kernels: RMSNorm (+ residual add), SiLU-and-mul, neox rotary, KV write.

Each program owns one token row, so launches need no host-side knowledge of values (capturable
in CUDA graphs). Math runs in fp32 and rounds where the torch reference in `common.model.ops`
rounds; inputs need only their last dimension contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.model.kernels.pdl import pdl_args, pdl_prologue


def _row_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


# fmt: off
@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x0, stride_x1, stride_r0, stride_r1, inner, n, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    # fmt: on
    """Row r of `[outer, inner, n]` (strided) -> contiguous out row r."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    a, b = row // inner, row % inner
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + a * stride_x0 + b * stride_x1 + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + a * stride_r0 + b * stride_r1 + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like torch's x + r
        tl.store(res_out_ptr + row * n + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # torch: weight * (x * rstd).to(x.dtype), in the promoted dtype of weight and x.
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * n + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `common.model.ops.rms_norm`; outputs are new contiguous tensors."""
    n = x.shape[-1]
    x3 = _as_3d(x)
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    res3 = x3 if residual is None else _as_3d(residual)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else out
    rows = x3.shape[0] * x3.shape[1]
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x3, res3, weight, out, res_out,
            x3.stride(0), x3.stride(1), res3.stride(0), res3.stride(1), x3.shape[1], n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_row_warps(block),
            **pdl_args(x.device),
        )  # fmt: skip
    return out if residual is None else (out, res_out)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """A `[outer, inner, n]` view (no copy for the usual 2-D and 3-D strided inputs)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3:
        return x
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x.reshape(-1, 1, x.shape[-1])


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, n, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + offs, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)  # torch rounds silu(gate) first
    y = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * n + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :n]) * x[..., n:]` for the last dim 2n."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1]) if x.stride(-1) == 1 else x.contiguous().view(-1, 2 * n)
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if x2.shape[0] and n:
        block = min(1024, triton.next_power_of_2(n))
        grid = (x2.shape[0], triton.cdiv(n, block))
        _silu_and_mul_kernel[grid](
            x2, out, x2.stride(0), n, BLOCK=block, num_warps=4, **pdl_args(x.device)
        )
    return out


@triton.jit
def _rotate_heads(base, stride_h, num_heads, cos, sin, norm_w_ptr, eps,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  NORM: tl.constexpr):  # fmt: skip
    """Rotate one token's heads in place; NORM first applies Qwen3's per-head RMSNorm
    (`norm_w_ptr`, [2 * HALF]) with `_rms_norm_kernel`'s rounding."""
    offs_h = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < num_heads)[:, None] & (offs < HALF)[None, :]
    first = base + offs_h[:, None] * stride_h + offs[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:
        squares = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
        rstd = tl.math.rsqrt(squares / (2 * HALF) + eps)[:, None]
        w1 = tl.load(norm_w_ptr + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(norm_w_ptr + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


# fmt: off
@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr = False, PDL: tl.constexpr = False,
):
    # fmt: on
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + offs, mask=offs < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + offs, mask=offs < HALF, other=0.0)[None, :]
    _rotate_heads(q_ptr + tok * stride_qt, stride_qh, num_q_heads, cos, sin, q_norm_ptr, eps,
                  HALF, BLOCK_HQ, BLOCK_HALF, NORM)  # fmt: skip
    _rotate_heads(k_ptr + tok * stride_kt, stride_kh, num_k_heads, cos, sin, k_norm_ptr, eps,
                  HALF, BLOCK_HK, BLOCK_HALF, NORM)  # fmt: skip


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[T, H, D]` and k `[T, Hk, D]` in place (neox halves); returns (q, k).

    `cos`/`sin` are fp32 `[max_positions, D // 2]` tables with equal strides. `qk_norm`
    (q weight, k weight, eps): each head is RMS-normalised first, in the same launch (Qwen3's
    q_norm and k_norm; weights [D] in q's dtype).
    """
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError("rotary needs the last dim of q, k, cos and sin contiguous")
    half = q.shape[-1] // 2
    q_w, k_w, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    if qk_norm is not None and not (q_w.shape == k_w.shape == (q.shape[-1],)
                                    and q_w.dtype == k_w.dtype == q.dtype == k.dtype):  # fmt: skip
        raise ValueError(
            f"qk_norm weights must be [{q.shape[-1]}] in {q.dtype}, got {q_w.dtype} "
            f"{tuple(q_w.shape)} and {k_w.dtype} {tuple(k_w.shape)}"
        )
    if q.shape[0]:
        _rotary_kernel[(q.shape[0],)](
            q, k, positions, cos, sin, q_w, k_w, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), q.shape[1], k.shape[1],
            HALF=half, BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
            BLOCK_HK=triton.next_power_of_2(k.shape[1]), BLOCK_HALF=triton.next_power_of_2(half),
            NORM=qk_norm is not None, num_warps=4, **pdl_args(q.device),
        )  # fmt: skip
    return q, k


@triton.jit
def _quantize_e4m3(x, scale):
    """`clamp(x / scale, -448, 448)` rounded to the nearest float8_e4m3fn, ties to even, as
    fp32 (exact in e4m3, so the final cast is exact). Rounding is done here rather than by the
    cast because Triton's CPU interpreter rounds fp8 casts half-up; adding then subtracting
    2^(e + 20) rounds |y| (< 2^(e + 1)) at e4m3's ulp 2^(e - 3) in fp32's own RTNE, and e
    never goes below -6, e4m3's subnormal ulp."""
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
    bits = y.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    exponent = tl.maximum((magnitude >> 23) - 127, -6)
    magic = ((exponent + 147) << 23).to(tl.float32, bitcast=True)  # 2^(exponent + 20)
    rounded = (magnitude.to(tl.float32, bitcast=True) + magic) - magic
    # The sign goes back on as a bit, so -0.0 and tiny negatives become -0.0, as in torch.
    sign = bits ^ magnitude
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


# fmt: off
@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch, num_heads,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr, PDL: tl.constexpr = False,
):
    # fmt: on
    pdl_prologue(PDL)  # before the early return: a waiting kernel must not end first
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs
    dst = dst + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if KV_FP8:
        k = _quantize_e4m3(k.to(tl.float32), k_scale)
        v = _quantize_e4m3(v.to(tl.float32), v_scale)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter k/v `[T, kv_heads, head_dim]` into the paged caches at `slot_mapping` (`[T]`,
    `block * page_size + offset`); tokens with a slot < 0 are skipped on the device. Into a
    float8_e4m3fn cache each value is stored as `clamp(x / scale, -448, 448)` rounded to
    nearest even (`fp8_ops.quantize`); other caches take a plain cast and ignore the scales."""
    if slot_mapping.shape[0] != k.shape[0] or k.shape != v.shape:
        raise ValueError(
            f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slot_mapping.shape)}"
        )
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError(f"K/V caches need equal strides, got {k_cache.stride()}, {v_cache.stride()}")
    kv_fp8 = k_cache.dtype == torch.float8_e4m3fn
    if kv_fp8 and not (v_cache.dtype == k_cache.dtype and k_scale > 0 and v_scale > 0):
        raise ValueError(
            f"FP8 KV needs both caches float8_e4m3fn and positive scales, got {k_cache.dtype}, "
            f"{v_cache.dtype}, k_scale={k_scale}, v_scale={v_scale}"
        )
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    if k.shape[0] == 0:
        return
    num_heads, head_dim = k.shape[1], k.shape[2]
    _write_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), num_heads,
        PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        KV_FP8=kv_fp8, num_warps=4, **pdl_args(k.device),
    )  # fmt: skip
