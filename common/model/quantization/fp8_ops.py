"""FP8 e4m3 quantization: torch reference implementations of what the GPU kernels fused into
RMSNorm / SiLU·mul (`common.model.kernels.fp8_quant`) reproduce bit for bit.

Rounding contract, shared by every helper: in float32, `q = (x / scale).clamp(-448, 448)`
then `.to(torch.float8_e4m3fn)` (round to nearest even); dequantized, `q.float() * scale`.
Dynamic scales are `amax * INV_FP8_MAX` of the row (or group), clamped below by `MIN_SCALE`
so an all-zero row quantizes to zeros instead of NaN. A product, not `amax / 448`: torch's
CUDA division by a scalar multiplies by its reciprocal while its CPU division rounds the
quotient, so only the product is the same number on every device (and in the kernels).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))  # 1/448 in float32
# vLLM's floor for dynamic scales: an amax below 1/512 quantizes to the same scale.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x` to FP8 with `scale` broadcast against it (the contract above)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dynamic_scale(amax: torch.Tensor) -> torch.Tensor:
    return (amax.float() * INV_FP8_MAX).clamp(min=MIN_SCALE)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (FP8 [M, K], float32 scales [M, 1])."""
    scale = dynamic_scale(x.abs().amax(dim=-1, keepdim=True))
    return quantize(x, scale), scale


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static activation scale (a float32 scalar from the checkpoint)."""
    return quantize(x, scale)


def quantize_per_token_group(
    x: torch.Tensor, group: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (FP8 [M, K], float32 scales [M, ceil(K / group)]): one scale per token and
    run of `group` columns (the last run may be shorter)."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k))
    scale = dynamic_scale(padded.view(m, groups, group).abs().amax(dim=-1))
    return quantize(x, expand_groups(scale, group, k)), scale


def expand_groups(scale: torch.Tensor, group: int, size: int) -> torch.Tensor:
    """Per-group scales [..., G] repeated over their columns, cut to `size` columns."""
    return scale.repeat_interleave(group, dim=-1)[..., :size]


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (FP8 [N, K], float32 scales [N, 1])."""
    return quantize_per_token(w)


def quantize_weight_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (FP8 [N, K], float32 scalar scale)."""
    scale = dynamic_scale(w.abs().amax())
    return quantize(w, scale), scale


def quantize_weight_blocks(
    w: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (FP8 [N, K], float32 scales [ceil(N / bn), ceil(K / bk)]), the layout of
    `weight_scale_inv`; edge blocks may be partial."""
    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w.float(), (0, cols * bk - k, 0, rows * bn - n))
    amax = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3))
    scale = dynamic_scale(amax)
    return quantize(w, expand_blocks(scale, block, (n, k))), scale


def expand_blocks(
    scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]
) -> torch.Tensor:
    """Block scales [ceil(N / bn), ceil(K / bk)] as one scale per element of an [N, K] weight."""
    rows = scale.repeat_interleave(block[0], dim=0)[: shape[0]]
    return expand_groups(rows, block[1], shape[1])


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """An FP8 checkpoint weight [N, K] with its stored scale -> float32 [N, K]. The scale's
    shape says its layout: one scalar ([] or [1]), one per row ([N, 1] or [N]), or `block`
    tiles [ceil(N / bn), ceil(K / bk)] (`weight_scale_inv`)."""
    n, k = q.shape
    s = scale.float()
    if s.numel() == 1:
        full = s.reshape(())
    elif s.shape in ((n,), (n, 1)):
        full = s.reshape(n, 1)
    elif s.shape == (-(-n // block[0]), -(-k // block[1])):
        full = expand_blocks(s, block, (n, k))
    else:
        raise ValueError(
            f"scale of shape {tuple(s.shape)} fits no FP8 layout of a [{n}, {k}] weight "
            f"(one scalar, one per row, or {block[0]}x{block[1]} blocks)"
        )
    return q.float() * full
