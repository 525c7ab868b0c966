"""Linear methods: how the parallel linear layers (`common.model.layers.linear`) store and
multiply their weights. `config` reads a checkpoint's scheme (torch-free: `ModelSpec` holds
it); `selection.linear_method_for` is the one place that maps it to a method: unquantized, or
one FP8 method per weight-scale layout (`fp8`, with `fp8_ops`, `fp8_gemm`, `fp8_loaders`);
`expert_quant_for` maps the same scheme to a mixture-of-experts layer's FP8 experts
(`fp8_experts`).
`activation` is the seam through which the ops feeding a linear layer hand it FP8 inputs.

The names below load on first use (PEP 562), so importing `config` from `ModelSpec` does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LinearMethod", "UnquantizedLinearMethod", "expert_quant_for", "linear_method_for"]
_HOMES = {
    "LinearMethod": "base",
    "UnquantizedLinearMethod": "unquantized",
    "expert_quant_for": "selection",
    "linear_method_for": "selection",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
