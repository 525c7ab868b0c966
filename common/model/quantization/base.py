"""The contract between a parallel linear layer and how its matmul is computed."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from common.model.quantization.activation import ActivationQuant, Fp8Activation

WeightLoader = Callable[..., None]


class LinearMethod:
    """How a linear layer stores and multiplies its weight (unquantized, FP8, ...).

    The layer owns the sharding: it tells `create_weights` its per-rank sizes and the loader
    that cuts its slice out of a full checkpoint tensor; the method registers the parameters
    on the layer (each with `weight_loader` set) and computes with them in `apply`. A method
    with its own parameters (scales) attaches its own loaders to them.
    """

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        weight_loader: WeightLoader,
    ) -> None:
        """Register `layer.weight` (and any extra parameters) for this rank: `input_size`
        columns, `output_sizes` rows per fused shard, in shard order."""
        raise NotImplementedError

    def input_quant(self, layer: nn.Module) -> ActivationQuant | None:
        """How `apply` wants its input: None for a plain tensor, else the FP8 layout in which
        the op producing it may hand over an `Fp8Activation` (so no separate quantization
        runs). Valid once the weights are loaded."""
        return None

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor | Fp8Activation,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`x` [M, K] -> [M, N]. An `Fp8Activation` comes only when `input_quant` asked.
        `out`, a contiguous [M, N] tensor of the output dtype, receives the result and is
        returned: a prefill graph's static buffer, which the GEMM can write directly where
        a copy would otherwise follow (`written_to` for the paths that cannot)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Runs once after every tensor is loaded (repacking, scale folding); none by default."""


def written_to(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """`result`, or its copy in `out` when the caller gave one (`LinearMethod.apply`)."""
    if out is None:
        return result
    return out.copy_(result.reshape(out.shape))
