"""The one place that maps a model's quantization to its linear method."""

from __future__ import annotations

from common.model.quantization.base import LinearMethod
from common.model.quantization.config import resolve_quantization
from common.model.quantization.fp8 import (
    Fp8BlockMethod,
    Fp8LinearMethod,
    Fp8PerChannelMethod,
    Fp8PerTensorMethod,
)
from common.model.quantization.fp8_experts import Fp8Experts
from common.model.quantization.unquantized import UnquantizedLinearMethod
from common.model.spec import ModelSpec

FP8_METHODS = {
    "tensor": Fp8PerTensorMethod,
    "channel": Fp8PerChannelMethod,
    "block": Fp8BlockMethod,
}


def linear_method_for(
    spec: ModelSpec, quantization: str = "auto", load_format: str = "auto"
) -> LinearMethod:
    """The method every decoder linear layer of `spec`'s model uses: the checkpoint's scheme
    (`spec.quantization`), FP8 quantized at load for `quantization="fp8"` on a high-precision
    checkpoint, else unquantized. The LM head and embeddings never take one."""
    scheme = resolve_quantization(spec.quantization, quantization, load_format)
    if scheme is None:
        return UnquantizedLinearMethod()
    return FP8_METHODS[scheme.weights](scheme)


def expert_quant_for(method: LinearMethod | None) -> Fp8Experts | None:
    """The FP8 scheme of a mixture-of-experts layer's experts, from the method its dense
    linear layers use (one checkpoint states one scheme for both); None: 16-bit experts."""
    if method is None or isinstance(method, UnquantizedLinearMethod):
        return None
    if isinstance(method, Fp8LinearMethod):
        return Fp8Experts(method.config)
    raise ValueError(f"experts have no quantized form for {type(method).__name__}")
