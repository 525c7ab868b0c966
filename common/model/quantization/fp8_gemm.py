"""FP8 matmuls: on CUDA `torch._scaled_mm` or the Triton kernels of
`common.model.kernels.fp8_gemm_kernels`, chosen by scale layout and M; a reference that
dequantizes everywhere else.

All compute out = (xq * x_scale) @ (w * w_scale).T with float32 accumulation: the reference
dequantizes the already-quantized operands exactly, so the CPU suite sees the numbers the GPU
paths compute (up to accumulation order). The choice reads only shapes (M is a Python int), so
CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.model.quantization.base import written_to

# Thresholds on M from benchmarks/bench_fp8_linear.py on one H200 (graph-replayed GEMM time,
# Qwen2.5-7B and Qwen3-8B linears; speedups over bf16 summed over a model's linears).
# Row-wise scales: the Triton kernel up to TRITON_MAX_M (1.46-1.67x, where row-wise
# `_scaled_mm` gave 0.90-1.11x); unit-scale `_scaled_mm` + Triton epilogue up to
# EPILOGUE_MAX_M (1.39-1.44x at 128, against 1.11-1.26x); row-wise `_scaled_mm` above (from
# 256 within noise of the epilogue path, 1.62-1.72x at 2048-8192).
TRITON_MAX_M = 64
EPILOGUE_MAX_M = 128
# Block-scaled: the Triton kernel up to BLOCK_TRITON_MAX_M (1.21-1.44x at M <= 8, where
# cuBLASLt gives 0.94-1.17x; on a par at 32-64); cuBLASLt's block-scaled `_scaled_mm` above
# (0.98-1.06x at 128, 1.4-1.63x from 512, where the Triton kernel gives 0.55-0.78x), when the
# caller can give it the block scales.
BLOCK_TRITON_MAX_M = 64


def fp8_linear(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """xq FP8 [M, K] with x_scale a float32 scalar or [M, 1]; weight FP8 [N, K] (row-major)
    with w_scale a float32 scalar or [N]. Two scalars take per-tensor `_scaled_mm` at every M.
    `out`: as `LinearMethod.apply` (the cuBLASLt paths write it directly)."""
    if not xq.is_cuda:
        return written_to(out, reference_linear(xq, x_scale, weight, w_scale, out_dtype, bias))
    m, k, n = xq.shape[0], xq.shape[1], weight.shape[0]
    if x_scale.numel() == 1 and w_scale.numel() == 1 and k % 16 == 0 and n % 16 == 0:
        return scaled_mm_linear(xq, x_scale, weight, w_scale, out_dtype, bias, out)
    if m <= TRITON_MAX_M or k % 16 or n % 16:  # cuBLASLt wants K and N multiples of 16
        from common.model.kernels import fp8_gemm_kernels

        y = fp8_gemm_kernels.w8a8_channel_mm(xq, x_scale, weight, w_scale, out_dtype, bias)
        return written_to(out, y)
    if m <= EPILOGUE_MAX_M:
        y = unit_scale_mm_linear(xq, x_scale, weight, w_scale, out_dtype, bias)
        return written_to(out, y)
    return scaled_mm_linear(xq, x_scale, weight, w_scale, out_dtype, bias, out)


def block_fp8_linear_cuda(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale_rows: torch.Tensor,
    group_k: int,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    w_block_scales: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`block_fp8_linear` on CUDA: xq FP8 [M, K] with x_scale [M, KB] (per token and group_k
    columns), weight FP8 [N, K] with w_scale_rows [N, KB] (each row's block scales), KB =
    ceil(K / group_k). `w_block_scales`, the [ceil(N / 128), KB] block scales, may be given
    only when output row i uses block row i // 128 (every fused shard but the last a multiple
    of 128 rows); above BLOCK_TRITON_MAX_M it selects cuBLASLt's block-scaled GEMM."""
    m, k, n = xq.shape[0], xq.shape[1], weight.shape[0]
    # K in whole groups of 4 blocks: the only layout torch 2.11 computes right.
    cublas_shape = group_k == 128 and k % 512 == 0 and n % 16 == 0
    if w_block_scales is not None and m > BLOCK_TRITON_MAX_M and cublas_shape:
        return block_scaled_mm_linear(xq, x_scale, weight, w_block_scales, out_dtype, bias, out)
    from common.model.kernels import fp8_gemm_kernels

    y = fp8_gemm_kernels.w8a8_block_mm(xq, x_scale, weight, w_scale_rows, group_k, out_dtype, bias)
    return written_to(out, y)


def block_scaled_mm_linear(xq, x_scale, weight, w_block_scales, out_dtype, bias, out=None):
    """cuBLASLt's DeepSeek-style GEMM (sm90, CUDA >= 12.9): 1 x 128 activation scales
    [M, KB] and 128 x 128 weight scales [NB, KB], KB a multiple of 4. The layouts torch 2.11
    reads: activation scales M-major (M padded here to a multiple of 4; the quantizing
    kernels already store them so when `ActivationQuant.m_major_from` asks, and the copy
    below is then a view), weight scales [KB, NB] K-block-major. Outputs bfloat16 or float32 (fp16 goes through bfloat16). With KB
    not a multiple of 4 torch 2.11 either refuses the scales or, given them unpadded,
    returns wrong numbers (seen on an H200), hence the ValueError. `out`: as
    `LinearMethod.apply`, written by the GEMM when no padding, bias or cast follows it."""
    m, kb = x_scale.shape
    if kb % 4:
        raise ValueError(f"cuBLASLt block scales need K blocks in multiples of 4, got {kb}")
    direct = out is not None and m % 4 == 0 and bias is None and out_dtype == torch.bfloat16
    if m % 4:
        pad = 4 - m % 4
        xq = F.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(xq.dtype)
        x_scale = F.pad(x_scale, (0, 0, 0, pad), value=1.0)
    mm_dtype = torch.float32 if out_dtype == torch.float32 else torch.bfloat16
    y = torch._scaled_mm(
        xq, weight.t(), scale_a=x_scale.t().contiguous().t(), scale_b=w_block_scales.t(),
        out_dtype=mm_dtype, **({"out": out} if direct else {}),
    )  # fmt: skip
    if direct:
        return y
    y = y[:m]
    return written_to(out, (y if bias is None else y + bias).to(out_dtype))


def scaled_mm_linear(xq, x_scale, weight, w_scale, out_dtype, bias, out=None):
    """cuBLASLt FP8 GEMM. It wants the second operand column-major: `weight.t()` of a
    row-major [N, K] weight is exactly that, no copy. Per-tensor: two scalar scales; otherwise
    row-wise, which takes scale_a [M, 1] and scale_b [1, N] (a scalar side is expanded).
    Assumptions to check on the GPU: row-wise scaling outputs bfloat16 only (torch <= 2.7),
    and K, N multiples of 16. A bfloat16 bias (Qwen2's qkv) is added in the GEMM's epilogue,
    rounded once: as a separate add it took 25 us of a 2k-token prefill's qkv on an H200.
    `out`: as `LinearMethod.apply`, written by the GEMM when nothing follows it."""
    m, n = xq.shape[0], weight.shape[0]
    if x_scale.numel() == 1 and w_scale.numel() == 1:
        direct = out is not None and bias is None
        y = torch._scaled_mm(
            xq, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype,
            **({"out": out} if direct else {}),
        )  # fmt: skip
        if direct:
            return y
        return written_to(out, (y if bias is None else y + bias).to(out_dtype))
    scale_a = x_scale.reshape(-1, 1).expand(m, 1).contiguous()
    scale_b = w_scale.reshape(1, -1).expand(1, n).contiguous()
    fused = bias is not None and bias.dtype == torch.bfloat16
    direct = out is not None and (bias is None or fused) and out_dtype == torch.bfloat16
    y = torch._scaled_mm(
        xq, weight.t(), scale_a=scale_a, scale_b=scale_b, bias=bias if fused else None,
        out_dtype=torch.bfloat16, **({"out": out} if direct else {}),
    )  # fmt: skip
    if direct:
        return y
    return written_to(out, (y if bias is None or fused else y + bias).to(out_dtype))


def unit_scale_mm_linear(xq, x_scale, weight, w_scale, out_dtype, bias):
    """Per-tensor `_scaled_mm` with unit scales (the fast cuBLASLt kernel), then one Triton
    pass applying x_scale[m] * w_scale[n] and the bias. The unscaled product of FP8 values
    can pass 65504, so it is held in bfloat16 (float32 for a float32 output), never fp16."""
    from common.model.kernels import fp8_gemm_kernels

    one = torch.ones((), dtype=torch.float32, device=xq.device)
    acc_dtype = torch.float32 if out_dtype == torch.float32 else torch.bfloat16
    acc = torch._scaled_mm(xq, weight.t(), scale_a=one, scale_b=one, out_dtype=acc_dtype)
    return fp8_gemm_kernels.scale_epilogue(acc, x_scale, w_scale, out_dtype, bias)


def reference_linear(xq, x_scale, weight, w_scale, out_dtype, bias):
    """The dequantizing path. `w_scale` is a scalar, one per output row ([N]), or one per
    element ([N, K]: block scales already expanded, the path a Triton block-scaled GEMM will
    replace on CUDA); `x_scale` broadcasts against `xq` likewise."""
    x = xq.float() * x_scale
    w = weight.float() * (w_scale.reshape(-1, 1) if w_scale.dim() == 1 else w_scale)
    return F.linear(x, w, None if bias is None else bias.float()).to(out_dtype)


def block_fp8_linear(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale_rows: torch.Tensor,
    group_k: int,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    w_block_scales: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block-scaled FP8 GEMM: xq FP8 [M, K] with x_scale float32 [M, KB] (one per token and
    `group_k` columns, KB = ceil(K / group_k)); weight FP8 [N, K] with w_scale_rows float32
    [N, KB] (each output row's block scales) -> [M, N] in `out_dtype`. `w_block_scales`: see
    `block_fp8_linear_cuda`; the reference does not need them. `out`: as
    `LinearMethod.apply`."""
    if xq.is_cuda:
        return block_fp8_linear_cuda(
            xq, x_scale, weight, w_scale_rows, group_k, out_dtype, bias, w_block_scales, out
        )
    from common.model.quantization.fp8_ops import expand_groups

    k = xq.shape[-1]
    x_scale, w_scale = expand_groups(x_scale, group_k, k), expand_groups(w_scale_rows, group_k, k)
    return written_to(out, reference_linear(xq, x_scale, weight, w_scale, out_dtype, bias))
