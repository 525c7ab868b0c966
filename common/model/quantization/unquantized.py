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

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if out is None:
            return F.linear(x, layer.weight, bias)
        # What F.linear runs for a 2-D input (mm, or addmm with the bias), into `out`.
        if bias is None:
            return torch.mm(x, layer.weight.t(), out=out)
        return torch.addmm(bias, x, layer.weight.t(), out=out)
