from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.model.quantization.base import LinearMethod, WeightLoader


class UnquantizedLinearMethod(LinearMethod):
    """A weight in the model's dtype and one `F.linear`: nothing else runs in the captured
    decode graph."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        weight_loader: WeightLoader,
    ) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size))
        weight.weight_loader = weight_loader
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
