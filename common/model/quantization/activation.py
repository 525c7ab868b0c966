"""The seam between the kernels that produce a linear layer's input and its FP8 matmul.

A linear method says how it wants its input (`LinearMethod.input_quant`: an `ActivationQuant`,
or None for a plain tensor); the producing op (RMSNorm, SiLU-and-mul, `common.model.ops`)
then emits an `Fp8Activation` directly, which the method multiplies as is. The torch
reference here is what CPU runs and what the Triton kernels (`common.model.kernels.fp8_quant`)
reproduce bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.model.quantization import fp8_ops

LAYOUTS = ("token", "group", "static")


@dataclass(frozen=True, eq=False)
class ActivationQuant:
    """The FP8 layout a linear layer wants its input in (`QuantConfig.activations`):
    "token" (dynamic, one scale per row), "group" (dynamic, one per row and `group` columns,
    a power of two) or "static" (`scale`, a float32 scalar tensor on the input's device).

    `m_major_from`: group scales of at least this many rows (a multiple of 4) are stored
    M-major, [M, KB] with strides (1, M), which is how cuBLASLt's block-scaled GEMM reads
    them; stored row-major, each such GEMM first copied them into that layout (an H200
    spent 2.6 us a linear on it at 2048 rows). None keeps them row-major."""

    layout: str
    group: int = 128
    scale: torch.Tensor | None = None
    m_major_from: int | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"activation layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.group <= 0 or self.group & (self.group - 1):
            raise ValueError(f"activation group must be a power of two, got {self.group}")
        static = self.layout == "static"
        if static != (self.scale is not None):
            raise ValueError(f"a scale goes with the static layout only, got {self.layout!r}")
        if static and (self.scale.numel() != 1 or self.scale.dtype != torch.float32):
            raise ValueError(
                f"static activation scale must be one float32, got {self.scale.dtype} "
                f"{tuple(self.scale.shape)}"
            )


@dataclass(frozen=True, eq=False)
class Fp8Activation:
    """An activation already in FP8. `data`: float8_e4m3fn [..., K]; `scale`: float32 [M, 1]
    ("token"), [M, ceil(K / group)] ("group") or the static scalar, M being `data`'s rows;
    `dtype`: the activation's own dtype, which the linear layer outputs."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def quantize_activation(x: torch.Tensor, quant: ActivationQuant) -> Fp8Activation:
    """The torch reference: `x` [..., K] rounded by `fp8_ops` in `quant`'s layout."""
    rows = x.reshape(-1, x.shape[-1])
    if quant.layout == "token":
        q, scale = fp8_ops.quantize_per_token(rows)
    elif quant.layout == "group":
        q, scale = fp8_ops.quantize_per_token_group(rows, quant.group)
    else:
        q, scale = fp8_ops.quantize_per_tensor(rows, quant.scale), quant.scale
    return Fp8Activation(q.view(x.shape), scale, x.dtype)
