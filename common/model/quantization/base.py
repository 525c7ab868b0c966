"""The contract between a parallel linear layer and how its matmul is computed."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

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

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Runs once after every tensor is loaded (repacking, scale folding); none by default."""
