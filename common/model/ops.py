"""The model's elementwise ops, one name each: Triton kernels on CUDA, torch everywhere else.

The torch versions are the reference (and what CPU runs, bit for bit what the HF-equality
tests check). The Triton versions (`common.model.kernels.fused_ops`, `.fp8_quant`) are imported
on first CUDA use only, so importing the model never imports or decorates a kernel. The `_fp8`
variants emit their output already quantized for an FP8 linear layer (`ActivationQuant`).
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from common.model.quantization.activation import (
    ActivationQuant,
    Fp8Activation,
    quantize_activation,
)


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and _triton_importable()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim in fp32, scaled by `weight`.

    With `residual`, returns `(norm(x + residual), x + residual)`: the caller carries the
    un-normalised sum to the next layer, as every pre-norm decoder does.
    """
    if _use_triton(x):
        from common.model.kernels import fused_ops

        return fused_ops.rms_norm(x, weight, eps, residual)
    if residual is None:
        return _rms_norm(x, weight, eps)
    x = x + residual
    return _rms_norm(x, weight, eps), x


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` where the last dim is `[gate | up]`."""
    if _use_triton(gate_up):
        from common.model.kernels import fused_ops

        return fused_ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    quant: ActivationQuant,
) -> tuple[Fp8Activation, torch.Tensor | None]:
    """`rms_norm`'s output quantized as `quant` says, and the new residual (None without
    `residual`)."""
    if _use_triton(x):
        from common.model.kernels import fp8_quant

        return fp8_quant.rms_norm_fp8(x, weight, eps, residual, quant)
    if residual is None:
        return quantize_activation(_rms_norm(x, weight, eps), quant), None
    x = x + residual
    return quantize_activation(_rms_norm(x, weight, eps), quant), x


def silu_and_mul_fp8(gate_up: torch.Tensor, quant: ActivationQuant) -> Fp8Activation:
    """`silu_and_mul`'s output quantized as `quant` says."""
    if _use_triton(gate_up):
        from common.model.kernels import fp8_quant

        return fp8_quant.silu_and_mul_fp8(gate_up, quant)
    gate, up = gate_up.chunk(2, dim=-1)
    return quantize_activation(F.silu(gate) * up, quant)


def quantize_fp8(x: torch.Tensor, quant: ActivationQuant) -> Fp8Activation:
    """`x` quantized as `quant` says (one kernel on CUDA)."""
    if _use_triton(x):
        from common.model.kernels import fp8_quant

        return fp8_quant.quantize_fp8(x, quant)
    return quantize_activation(x, quant)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary (rotate halves) of q `[T, H, D]` and k `[T, Hk, D]` at `positions`,
    from fp32 `[max_positions, D // 2]` cos/sin tables. Returns the rotated (q, k).

    `qk_norm` (q weight, k weight, eps): `rms_norm` of each head first, as Qwen3's q_norm and
    k_norm; on CUDA in the same launch as the rotation when the weights are in q's dtype.

    The Triton path rotates in place and returns its inputs; the torch path returns new
    tensors. Callers use the return value and do not reuse the inputs.
    """
    fused = qk_norm is not None and qk_norm[0].dtype == qk_norm[1].dtype == q.dtype == k.dtype
    if qk_norm is not None and not (fused and _use_triton(q)):
        q_w, k_w, eps = qk_norm
        q, k, qk_norm = rms_norm(q, q_w, eps), rms_norm(k, k_w, eps), None
    if _use_triton(q):
        from common.model.kernels import fused_ops

        return fused_ops.apply_rotary(q, k, positions, cos, sin, qk_norm)
    cos = cos[positions].unsqueeze(1)  # [T, 1, D/2]
    sin = sin[positions].unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
