"""Linear methods: how the parallel linear layers (`common.model.layers.linear`) store and
multiply their weights. A quantization scheme is one more `LinearMethod` subclass, chosen in
`linear_method_for`."""

from __future__ import annotations

from common.model.quantization.base import LinearMethod
from common.model.quantization.unquantized import UnquantizedLinearMethod
from common.model.spec import ModelSpec

__all__ = ["LinearMethod", "UnquantizedLinearMethod", "linear_method_for"]


def linear_method_for(spec: ModelSpec) -> LinearMethod:
    """The method every linear layer of `spec`'s model uses. `ModelSpec` reads no
    quantization config yet, so this is always the unquantized one; a scheme adds its
    branch here."""
    del spec
    return UnquantizedLinearMethod()
