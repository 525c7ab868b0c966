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
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_scale(inv_freq, head_dim, rope)
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


def _yarn_scale(inv_freq: torch.Tensor, head_dim: int, rope: RopeSpec) -> torch.Tensor:
    # YaRN: dimensions that turn more than `beta_fast` times over the pre-training length keep
    # their frequency, those under `beta_slow` turns are divided by `factor`, a linear ramp
    # in between.
    def turns_to_dim(turns: float) -> float:
        wavelengths = rope.original_max_position / (turns * 2 * math.pi)
        return head_dim * math.log(wavelengths) / (2 * math.log(rope.theta))

    low, high = turns_to_dim(rope.beta_fast), turns_to_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    interpolated = 1.0 / (rope.factor * rope.theta**exponents)
    return interpolated * (1 - keep) + inv_freq * keep


class RotaryEmbedding(nn.Module):
    """Rotary embedding with a precomputed cos/sin table (yarn's `cos_sin_scale` folded in).

    Neox style rotates the halves of each head. `rope.interleaved` rotates adjacent pairs:
    the pairs are first gathered into halves, so the result is laid out as Neox's (the even
    members' outputs, then the odd ones'). q and k get the same layout, so every q.k equals
    that of the interleaved rotation; nothing else reads these values."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeSpec) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        scale = rope.cos_sin_scale
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)
        self.interleaved = rope.interleaved

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
    ):
        """Returns the rotated (q, k), each head first normalised by `qk_norm` (Qwen3's q_norm
        and k_norm; one launch with the rotation on CUDA); on CUDA they are rotated in place
        (`ops.apply_rotary`), unless interleaved (rotated copies)."""
        norms = None
        if qk_norm is not None:
            q_norm, k_norm = qk_norm
            norms = (q_norm.weight, k_norm.weight, q_norm.eps)
        if self.interleaved:
            if norms is not None:  # normalised in the checkpoint's pair order
                q, k, norms = q_norm(q), k_norm(k), None
            q, k = _pairs_to_halves(q), _pairs_to_halves(k)
        return ops.apply_rotary(q, k, positions, self.cos, self.sin, norms)


def _pairs_to_halves(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
