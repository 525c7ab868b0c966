"""FP8 weights of a mixture-of-experts layer's stacked experts (`layers.moe.Experts`): their
parameters, their checkpoint scales, quantization at load, the scale layout the expert kernels
read (`ExpertScales`) and the torch reference of the FP8 expert computation (`reference`).

The experts compute W8A8, as the dense layers do: the tokens are quantized to FP8 before the
gate_up GEMM (per token and 128 columns with block weights, per token otherwise), SiLU(gate) *
up is computed in float32 and stored in x's dtype, quantized the same way before the down GEMM,
and each product of FP8 values is summed in float32 and scaled by the activation's and the
weight's scales of its K block. On the GPU the FP8 tensor cores multiply (`fused_moe`); a
first version that dequantized each weight tile to 16 bits inside the kernels ran slower than
bf16 on an H200 (Qwen3-30B-A3B decode 4.6 ms a step against 3.3; docs/benchmarks.md).

Scale layouts, by the checkpoint's scheme (`QuantConfig.weights`); `ExpertScales` holds the
scale of weight element (n, k) at [e, n // group_n, k // group_k]:
- block (`weight_scale_inv` [ceil(N / 128), ceil(K / 128)] per expert tensor, as Qwen3-*-FP8
  and DeepSeek-V3 publish): 128 x 128. This rank's intermediate slice must be whole blocks, so
  that the gate and up halves stack into one block grid and down's K columns cut on blocks.
- channel (compressed-tensors FP8_DYNAMIC `weight_scale` [N, 1]; `--quantization fp8`):
  group_n 1 and one scale column (group_k 0).
- tensor (`weight_scale`, one scalar per expert tensor): held per channel, every row of a
  tensor its scalar (exact). A static `input_scale` is not used: expert activations are
  quantized per token at run time.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from common.model.layers.moe_routing import pairs_by_expert
from common.model.layers.weights import copy_checked
from common.model.quantization import fp8_ops
from common.model.quantization.activation import ActivationQuant, quantize_activation
from common.model.quantization.config import QuantConfig
from common.model.quantization.fp8_loaders import block_range


@dataclasses.dataclass(frozen=True)
class ExpertScales:
    """float32 scales of FP8 expert weights: `w13` [E, ceil(2I / group_n), KB(H)] for gate_up
    [E, 2I, H], `w2` [E, ceil(H / group_n), KB(I)] for down [E, H, I]; KB(K) = ceil(K /
    group_k), or 1 when group_k is 0 (one scale per row)."""

    w13: torch.Tensor
    w2: torch.Tensor
    group_n: int
    group_k: int

    @property
    def activation_quant(self) -> ActivationQuant:
        """How the tokens (and the SiLU-and-mul output) are quantized: per token and group_k
        columns with block weights, per token with per-row ones."""
        return (
            ActivationQuant("group", group=self.group_k)
            if self.group_k
            else ActivationQuant("token")
        )


def dequantize(q: torch.Tensor, scale: torch.Tensor, group_n: int, group_k: int) -> torch.Tensor:
    """FP8 [E, N, K] with its scales ([E, N / group_n, KB]) -> float32, q * scale."""
    n, k = q.shape[1], q.shape[2]
    full = scale.repeat_interleave(group_n, dim=1)[:, :n]
    if group_k:
        full = full.repeat_interleave(group_k, dim=2)[:, :, :k]
    return q.float() * full


def fake_quantize(x: torch.Tensor, quant: ActivationQuant) -> torch.Tensor:
    """`x` [T, K] quantized to FP8 in `quant`'s layout and back, in float32."""
    act = quantize_activation(x, quant)
    scale = act.scale
    if quant.layout == "group":
        scale = fp8_ops.expand_groups(scale, quant.group, x.shape[-1])
    return act.data.float() * scale


def reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    scales: ExpertScales,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The FP8 experts' output [T, H] in x's dtype, by a loop over the experts in float32 on
    the dequantized operands: the kernels' numbers up to summation order (their h is stored
    in x's dtype before its quantization, as here). Ids outside [0, E) add nothing."""
    quant = scales.activation_quant
    w13 = dequantize(w13, scales.w13, scales.group_n, scales.group_k)
    w2 = dequantize(w2, scales.w2, scales.group_n, scales.group_k)
    xq = fake_quantize(x, quant)
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for expert, token, slot in pairs_by_expert(topk_ids, w13.shape[0]):
        gate_up = xq[token] @ w13[expert].T
        h = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        y = fake_quantize(h, quant) @ w2[expert].T
        out.index_add_(0, token, y * topk_weights[token, slot].unsqueeze(-1).float())
    return out.to(x.dtype)


class Fp8Experts:
    """The FP8 scheme of one model's experts. `Experts` calls it to create its parameters,
    load the scale tensors and finish loading; `scales` hands the kernels their layout."""

    def __init__(self, config: QuantConfig) -> None:
        self.config = config
        self.block = config.weights == "block"
        self.group_n, self.group_k = config.block if self.block else (1, 0)

    @property
    def weight_dtype(self) -> torch.dtype:
        """FP8 from an FP8 checkpoint; else the model dtype, quantized in `finish_loading`."""
        return fp8_ops.FP8 if self.config.from_checkpoint else torch.get_default_dtype()

    def check(self, experts: nn.Module) -> None:
        """Block scales need this rank's intermediate slice in whole blocks (refused at build,
        not mid-load)."""
        size, full = len(experts.columns), experts.full_intermediate
        if self.block and (size % self.group_n or experts.columns.start % self.group_n):
            raise ValueError(
                f"expert intermediate columns {experts.columns.start}..{experts.columns.stop} "
                f"of {full} are not aligned to the {self.group_n}-wide FP8 weight blocks; "
                "choose a tensor-parallel size (or --enable-expert-parallel) that splits on "
                "block boundaries"
            )

    def create_scales(self, experts: nn.Module, hidden: int) -> None:
        """The scale parameters an FP8 checkpoint fills (none when quantizing at load: the
        scales come into being in `finish_loading`)."""
        if not self.config.from_checkpoint:
            return
        count, size = len(experts.expert_range), len(experts.columns)
        w13 = torch.ones(count, *self._grid(2 * size, hidden), dtype=torch.float32)
        w2 = torch.ones(count, *self._grid(hidden, size), dtype=torch.float32)
        experts.gate_up_proj_scale = _param(w13, experts.load_gate_up_scale)
        experts.down_proj_scale = _param(w2, experts.load_down_scale)

    def _grid(self, n: int, k: int) -> tuple[int, int]:
        if self.block:
            return -(-n // self.group_n), -(-k // self.group_k)
        return n, 1

    def load_gate_up_scale(self, experts: nn.Module, dst: torch.Tensor, loaded: torch.Tensor,
                           half: int) -> None:  # fmt: skip
        """One expert's gate (or up) scale as published -> its rows of `dst` ([rows, KB])."""
        size, full = len(experts.columns), experts.full_intermediate
        if self.block:
            blocks = block_range(experts.columns, full, self.group_n, "expert rows")
            if loaded.dim() != 2 or loaded.shape[0] != -(-full // self.group_n):
                raise ValueError(f"has shape {tuple(loaded.shape)}, expected block scales")
            rows = dst.narrow(0, half * len(blocks), len(blocks))
            copy_checked(rows, loaded[blocks.start : blocks.stop])
            return
        rows = dst.narrow(0, half * size, size)
        self._load_rows(rows, loaded, full, experts.columns)

    def load_down_scale(self, experts: nn.Module, dst: torch.Tensor,
                        loaded: torch.Tensor) -> None:  # fmt: skip
        """One expert's down scale as published -> `dst` ([rows, KB]); block columns cut to
        this rank's intermediate slice."""
        if self.block:
            full = experts.full_intermediate
            cols = block_range(experts.columns, full, self.group_k, "expert input columns")
            if loaded.dim() != 2 or loaded.shape[1] != -(-full // self.group_k):
                raise ValueError(f"has shape {tuple(loaded.shape)}, expected block scales")
            copy_checked(dst, loaded[:, cols.start : cols.stop])
            return
        self._load_rows(dst, loaded, dst.shape[0], range(dst.shape[0]))

    def _load_rows(self, dst: torch.Tensor, loaded: torch.Tensor, full: int, rows: range) -> None:
        """Per-row scales ([N, 1] or [N]) sliced to `rows`; a per-tensor scalar fills them."""
        if loaded.numel() == 1:
            dst.fill_(loaded.reshape(()).float())
            return
        if loaded.numel() != full:
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected {full} row scales")
        copy_checked(dst, loaded.reshape(full, 1)[rows.start : rows.stop].float())

    def finish_loading(self, experts: nn.Module) -> None:
        """Quantize 16/32-bit experts (a high-precision checkpoint or dummy weights) in the
        scheme's layout: blocks for a block scheme, else one scale per row."""
        if self.config.from_checkpoint:
            return
        for name in ("gate_up_proj", "down_proj"):
            q, scale = self._quantize(getattr(experts, name).data)
            setattr(experts, name, _param(q))
            setattr(experts, f"{name}_scale", _param(scale))

    def _quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [
            fp8_ops.quantize_weight_blocks(one, self.config.block)
            if self.block
            else fp8_ops.quantize_weight_per_channel(one)
            for one in w
        ]  # one expert at a time: a whole layer in float32 would be 4x its 8-bit size
        return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])

    def scales(self, experts: nn.Module) -> ExpertScales:
        return ExpertScales(
            experts.gate_up_proj_scale, experts.down_proj_scale, self.group_n, self.group_k
        )


def _param(data: torch.Tensor, loader=None) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    if loader is not None:
        param.weight_loader = loader
    return param
