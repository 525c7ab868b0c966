"""FP8 matmuls: `torch._scaled_mm` on CUDA, a reference that dequantizes everywhere else.

Both compute out = (xq * x_scale) @ (w * w_scale).T with float32 accumulation: the reference
dequantizes the already-quantized operands exactly, so the CPU suite sees the numbers the GPU
path computes (up to accumulation order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fp8_linear(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """xq FP8 [M, K] with x_scale a float32 scalar or [M, 1]; weight FP8 [N, K] (row-major)
    with w_scale a float32 scalar or [N]."""
    if xq.is_cuda:
        return scaled_mm_linear(xq, x_scale, weight, w_scale, out_dtype, bias)
    return reference_linear(xq, x_scale, weight, w_scale, out_dtype, bias)


def scaled_mm_linear(xq, x_scale, weight, w_scale, out_dtype, bias):
    """cuBLASLt FP8 GEMM. It wants the second operand column-major: `weight.t()` of a
    row-major [N, K] weight is exactly that, no copy. Per-tensor: two scalar scales; otherwise
    row-wise, which takes scale_a [M, 1] and scale_b [1, N] (a scalar side is expanded).
    Assumptions to check on the GPU: row-wise scaling outputs bfloat16 only (torch <= 2.7),
    and K, N multiples of 16."""
    m, n = xq.shape[0], weight.shape[0]
    if x_scale.numel() == 1 and w_scale.numel() == 1:
        out = torch._scaled_mm(
            xq, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype
        )
    else:
        scale_a = x_scale.reshape(-1, 1).expand(m, 1).contiguous()
        scale_b = w_scale.reshape(1, -1).expand(1, n).contiguous()
        out = torch._scaled_mm(
            xq, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16
        ).to(out_dtype)
    return out if bias is None else out + bias


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
) -> torch.Tensor:
    """Block-scaled FP8 GEMM: xq FP8 [M, K] with x_scale float32 [M, KB] (one per token and
    `group_k` columns, KB = ceil(K / group_k)); weight FP8 [N, K] with w_scale_rows float32
    [N, KB] (each output row's block scales) -> [M, N] in `out_dtype`."""
    from common.model.quantization.fp8_ops import expand_groups

    k = xq.shape[-1]
    # CUDA takes the dequantizing path too until the Triton block-scaled GEMM replaces it.
    x_scale, w_scale = expand_groups(x_scale, group_k, k), expand_groups(w_scale_rows, group_k, k)
    return reference_linear(xq, x_scale, weight, w_scale, out_dtype, bias)
