"""Building blocks of the Llama family: RMSNorm, rotary embedding, SiLU-and-mul.

The ops that feed a linear layer take its `input_quant` and, when it is set, emit the
`Fp8Activation` the layer multiplies as is; None leaves them the plain ops.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from common.model import ops
from common.model.quantization.activation import ActivationQuant, Fp8Activation
from common.model.spec import RopeSpec


class RMSNorm(nn.Module):
    """RMSNorm in float32, optionally fused with the residual add (`ops.rms_norm`)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        quant: ActivationQuant | None = None,
    ):
        """`ops.rms_norm`'s output (and new residual), in FP8 when `quant` is set."""
        if quant is None:
            return ops.rms_norm(x, self.weight, self.eps, residual)
        out, residual_out = ops.rms_norm_fp8(x, self.weight, self.eps, residual, quant)
        return out if residual is None else (out, residual_out)


def silu_and_mul(
    gate_up: torch.Tensor, quant: ActivationQuant | None = None
) -> torch.Tensor | Fp8Activation:
    if quant is None:
        return ops.silu_and_mul(gate_up)
    return ops.silu_and_mul_fp8(gate_up, quant)


def quantize(x: torch.Tensor, quant: ActivationQuant | None) -> torch.Tensor | Fp8Activation:
    """`x` as a linear layer with `input_quant` `quant` takes it (one kernel on CUDA)."""
    return x if quant is None else ops.quantize_fp8(x, quant)


def rope_inv_freq(head_dim: int, rope: RopeSpec) -> torch.Tensor:
    inv_freq = 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    # Llama 3.1 keeps high frequencies, divides low ones by `factor`, and blends in between.
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves) with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeSpec) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Returns the rotated (q, k); on CUDA they are rotated in place (`ops.apply_rotary`)."""
        return ops.apply_rotary(q, k, positions, self.cos, self.sin)
