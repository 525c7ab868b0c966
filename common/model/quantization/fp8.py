"""FP8 W8A8 linear methods, one per weight-scale layout (`QuantConfig.weights`).

Every method holds `weight` as float8_e4m3fn [N, K] (this rank's rows and columns) and float32
scales. From an FP8 checkpoint the scales are parameters with their own loaders
(`fp8_loaders`); with `from_checkpoint` off, `weight` is created in the model dtype, filled from
a high-precision checkpoint (or dummy weights) and quantized in `process_weights_after_loading`.
Static activation scales (`input_scale`, one per fused shard) are reduced to their max: the
shards see the same input, so calibrated checkpoints store equal values, and the max clips
none of them.

Activations come as `Fp8Activation` from the op that produced them (`input_quant` says the
layout); a plain tensor is quantized here, in one kernel on CUDA
(`common.model.ops.quantize_fp8`).
"""

from __future__ import annotations

import torch
from torch import nn

from common.model.ops import quantize_fp8
from common.model.quantization import fp8_ops as ops
from common.model.quantization.activation import ActivationQuant, Fp8Activation
from common.model.quantization.base import LinearMethod, WeightLoader
from common.model.quantization.config import QuantConfig
from common.model.quantization.fp8_gemm import BLOCK_TRITON_MAX_M, block_fp8_linear, fp8_linear
from common.model.quantization.fp8_loaders import (
    BlockScaleLoader,
    per_row_loader,
    per_shard_scalar_loader,
)


def _param(data: torch.Tensor, loader: WeightLoader | None = None) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    if loader is not None:
        param.weight_loader = loader
    return param


class Fp8LinearMethod(LinearMethod):
    def __init__(self, config: QuantConfig) -> None:
        self.config = config

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        weight_loader: WeightLoader,
    ) -> None:
        layer.fp8_output_sizes = list(output_sizes)
        dtype = ops.FP8 if self.config.from_checkpoint else torch.get_default_dtype()
        weight = torch.empty(sum(output_sizes), input_size, dtype=dtype)
        layer.register_parameter("weight", _param(weight, weight_loader))
        if self.config.from_checkpoint:
            self.create_scales(layer, input_size, output_sizes)
            if self.config.activations == "static":
                scales = torch.ones(len(output_sizes), dtype=torch.float32)
                layer.register_parameter("input_scale", _param(scales, per_shard_scalar_loader))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.config.from_checkpoint:
            parts = layer.weight.data.split(layer.fp8_output_sizes)
            quantized = [self.quantize_weight(part) for part in parts]
            layer.weight = _param(torch.cat([q for q, _ in quantized]))
            self.store_scales(layer, [s for _, s in quantized])
            if self.config.activations == "static":
                # No calibration data: 1.0 keeps activations of unit size well inside ±448.
                layer.input_scale = _param(
                    torch.ones(1, dtype=torch.float32, device=layer.weight.device)
                )
        if self.config.activations == "static":
            layer.input_scale = _param(layer.input_scale.data.max().reshape(()))
        self.finish(layer)

    def input_quant(self, layer: nn.Module) -> ActivationQuant:
        if self.config.activations == "static":
            return ActivationQuant("static", scale=layer.input_scale)
        return ActivationQuant("token")

    def quantize_input(self, layer: nn.Module, x: torch.Tensor) -> Fp8Activation:
        """The separate quantization, for an input no kernel handed over in FP8."""
        return quantize_fp8(x, self.input_quant(layer))

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor | Fp8Activation,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        act = x if isinstance(x, Fp8Activation) else self.quantize_input(layer, x)
        shape = act.data.shape
        y = self.matmul(layer, act.data.reshape(-1, shape[-1]), act.scale, act.dtype, bias, out)
        return y.reshape(*shape[:-1], y.shape[-1])

    def matmul(
        self,
        layer: nn.Module,
        xq: torch.Tensor,
        x_scale: torch.Tensor,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """FP8 rows [M, K] with their scales in `input_quant`'s layout -> [M, N] (in `out`
        when given, as `LinearMethod.apply`)."""
        return fp8_linear(xq, x_scale, layer.weight, layer.weight_scale, out_dtype, bias, out)

    # Per layout:
    def create_scales(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        raise NotImplementedError

    def quantize_weight(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def store_scales(self, layer: nn.Module, scales: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def finish(self, layer: nn.Module) -> None:
        """Leave the scales in the layout `apply` reads."""


class Fp8PerTensorMethod(Fp8LinearMethod):
    """One weight scale per checkpoint tensor: q, k and v (gate, up) each bring theirs. They
    are folded into one scale per output row (exact: no requantization), or kept as one
    scalar when they agree, which is the fast per-tensor `_scaled_mm`."""

    def create_scales(self, layer, input_size, output_sizes):
        scales = torch.ones(len(output_sizes), dtype=torch.float32)
        layer.register_parameter("weight_scale", _param(scales, per_shard_scalar_loader))

    def quantize_weight(self, w):
        return ops.quantize_weight_per_tensor(w)

    def store_scales(self, layer, scales):
        layer.weight_scale = _param(torch.stack(scales))

    def finish(self, layer):
        scales = layer.weight_scale.data
        if bool((scales == scales[0]).all()):
            layer.weight_scale = _param(scales[0].clone())
            return
        sizes = torch.tensor(layer.fp8_output_sizes, device=scales.device)
        layer.weight_scale = _param(scales.repeat_interleave(sizes))


class Fp8PerChannelMethod(Fp8LinearMethod):
    """One weight scale per output row ([N, 1] in checkpoints, [N] after loading)."""

    def create_scales(self, layer, input_size, output_sizes):
        scales = torch.ones(sum(output_sizes), 1, dtype=torch.float32)
        layer.register_parameter("weight_scale", _param(scales, per_row_loader(layer)))

    def quantize_weight(self, w):
        return ops.quantize_weight_per_channel(w)

    def store_scales(self, layer, scales):
        layer.weight_scale = _param(torch.cat(scales))

    def finish(self, layer):
        layer.weight_scale = _param(layer.weight_scale.data.reshape(-1))


class Fp8BlockMethod(Fp8LinearMethod):
    """Weight scales per `block` tile (128 x 128), activations per token and 128 columns.
    Fused shards each start a new block row (`BlockScaleLoader`); `row_block` maps each
    output row to its block row, and after loading `weight_scale_rows` holds each output
    row's block scales ([N, ceil(K / 128)], what the GEMM reads). A TP size that cuts a
    block is refused when the layer is built."""

    def create_weights(self, layer, input_size, output_sizes, weight_loader):
        loader = BlockScaleLoader(layer, self.config.block, sum(output_sizes))
        rows, cols = loader.block_rows_per_shard(), loader.block_columns(input_size)
        bn = self.config.block[0]
        offsets = [sum(len(r) for r in rows[:i]) for i in range(len(rows))]
        index = [offsets[i] + j // bn for i, n in enumerate(output_sizes) for j in range(n)]
        layer.register_buffer("row_block", torch.tensor(index, dtype=torch.long), persistent=False)
        layer.fp8_block_shape = (sum(len(r) for r in rows), len(cols))
        layer.fp8_scale_loader = loader
        super().create_weights(layer, input_size, output_sizes, weight_loader)

    def create_scales(self, layer, input_size, output_sizes):
        scales = torch.ones(*layer.fp8_block_shape, dtype=torch.float32)
        param = _param(scales, layer.fp8_scale_loader)
        layer.register_parameter(self.config.scale_name, param)

    def quantize_weight(self, w):
        return ops.quantize_weight_blocks(w, self.config.block)

    def store_scales(self, layer, scales):
        setattr(layer, self.config.scale_name, _param(torch.cat(scales)))

    def finish(self, layer):
        blocks = getattr(layer, self.config.scale_name).data
        rows = blocks[layer.row_block].contiguous()
        layer.register_buffer("weight_scale_rows", rows, persistent=False)
        # cuBLASLt's block-scaled GEMM reads the [N/128, KB] block table itself, which holds
        # only when output row i sits in block row i // 128 (no fused shard ends mid-block).
        index = torch.arange(len(rows), device=blocks.device) // self.config.block[0]
        aligned = bool((layer.row_block == index).all())
        layer.register_buffer("weight_block_scales", blocks if aligned else None, persistent=False)

    def input_quant(self, layer):
        # Above BLOCK_TRITON_MAX_M rows the GEMM is cuBLASLt's, which reads the scales M-major.
        group = self.config.block[1]
        return ActivationQuant("group", group=group, m_major_from=BLOCK_TRITON_MAX_M + 1)

    def matmul(self, layer, xq, x_scale, out_dtype, bias, out=None):
        w, w_scale, bk = layer.weight, layer.weight_scale_rows, self.config.block[1]
        blocks = layer.weight_block_scales
        return block_fp8_linear(xq, x_scale, w, w_scale, bk, out_dtype, bias, blocks, out)
