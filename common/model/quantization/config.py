"""Which quantization scheme a checkpoint states in its config.json `quantization_config`,
read without torch (`ModelSpec` carries it; the launcher reads specs before any process starts).

Formats read (as published; the tensor names are what the checkpoint files hold):

- HF `quant_method: "fp8"` with `weight_block_size: [128, 128]` (Qwen3-*-FP8, DeepSeek):
  `weight` float8_e4m3fn [N, K] and `weight_scale_inv` float32 [ceil(N/128), ceil(K/128)],
  a multiplier despite its name (w = q * scale_inv); activations dynamic per token group.
- HF `quant_method: "fp8"` without blocks (AutoFP8 style): `weight` fp8 and `weight_scale`, one
  scalar per tensor; `activation_scheme` "static" adds an `input_scale` scalar, "dynamic"
  quantizes activations per token at run time.
- compressed-tensors `format` "float-quantized" / "naive-quantized" with one config group of
  8-bit float weights: strategy "channel" (FP8_DYNAMIC: `weight_scale` [N, 1], dynamic
  per-token activations) or "tensor" (`weight_scale` [1], static `input_scale` [1] or dynamic).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

QUANTIZATION_CHOICES = ("auto", "fp8")
SUPPORTED = (
    "supported: fp8 (HF, per-tensor or 128x128 blocks), compressed-tensors FP8 "
    "(per-channel or per-tensor), or --quantization fp8 on a bf16/fp16/fp32 checkpoint"
)


@dataclass(frozen=True)
class QuantConfig:
    """An FP8 W8A8 scheme. `weights`: "tensor" (one scale per checkpoint tensor), "channel"
    (one per output row) or "block" (one per `block` tile). `activations`: "static" (the
    checkpoint's `input_scale`), "token" (dynamic per token) or "group" (dynamic per token
    and group of `block[1]` columns). `from_checkpoint`: the checkpoint holds FP8 weights and
    their scales (named `scale_name`); False: it holds high-precision weights, quantized at load."""

    weights: str
    activations: str
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    from_checkpoint: bool = True

    def __post_init__(self) -> None:
        assert self.weights in ("tensor", "channel", "block"), self.weights
        assert self.activations in ("static", "token", "group"), self.activations
        assert (self.weights == "block") == (self.block is not None), self


# What `--quantization fp8` does to a high-precision checkpoint.
QUANTIZE_AT_LOAD = QuantConfig("channel", "token", from_checkpoint=False)


def parse_quantization_config(raw: dict[str, Any] | None) -> QuantConfig | None:
    """The scheme of a config.json's `quantization_config` (None: not quantized). Anything
    pdserve does not implement is a one-line ValueError naming it."""
    if not raw:
        return None
    method = raw.get("quant_method")
    if method == "fp8":
        return _hf_fp8(raw)
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    raise ValueError(
        f"quantization method {method!r} of this checkpoint is not supported; {SUPPORTED}"
    )


def resolve_quantization(
    checkpoint: QuantConfig | None, flag: str, load_format: str
) -> QuantConfig | None:
    """The scheme a model is built with: the checkpoint's, or `--quantization fp8` on a
    high-precision one. Dummy weights are drawn in the model dtype, so with them every
    scheme quantizes at load (in the checkpoint's layout: benchmarks run its shapes)."""
    if flag not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, got {flag!r}")
    scheme = checkpoint or (QUANTIZE_AT_LOAD if flag == "fp8" else None)
    if scheme is not None and load_format == "dummy":
        return dataclasses.replace(scheme, from_checkpoint=False)
    return scheme


def _hf_fp8(raw: dict[str, Any]) -> QuantConfig:
    activation = raw.get("activation_scheme", "dynamic")
    if activation not in ("static", "dynamic"):
        raise ValueError(f"fp8 activation_scheme {activation!r} is not supported; {SUPPORTED}")
    _check_ignored(raw.get("ignored_layers") or raw.get("modules_to_not_convert") or [])
    block = raw.get("weight_block_size")
    if block is None:
        return QuantConfig("tensor", "static" if activation == "static" else "token")
    if list(block) != [128, 128] or activation != "dynamic":
        raise ValueError(
            f"fp8 weight_block_size {block} with {activation} activations is not supported; "
            "blocks must be [128, 128] with dynamic activations"
        )
    return QuantConfig("block", "group", (128, 128), scale_name="weight_scale_inv")


def _compressed_tensors(raw: dict[str, Any]) -> QuantConfig:
    fmt = raw.get("format")
    groups = list((raw.get("config_groups") or {}).values())
    if fmt not in ("float-quantized", "naive-quantized") or len(groups) != 1:
        raise ValueError(
            f"compressed-tensors format {fmt!r} with {len(groups)} config groups is not "
            f"supported; {SUPPORTED}"
        )
    weights = groups[0].get("weights") or {}
    acts = groups[0].get("input_activations") or {}
    strategy, act = weights.get("strategy"), acts.get("strategy")
    fp8 = weights.get("type") == "float" and weights.get("num_bits") == 8
    ok_acts = (act == "token" and acts.get("dynamic")) or (act == "tensor")
    if not fp8 or strategy not in ("channel", "tensor") or not ok_acts:
        raise ValueError(
            f"compressed-tensors scheme (weights {weights.get('type')}{weights.get('num_bits')} "
            f"{strategy}, activations {act}) is not supported; {SUPPORTED}"
        )
    _check_ignored(raw.get("ignore") or [])
    static = act == "tensor" and not acts.get("dynamic")
    return QuantConfig(strategy, "static" if static else "token")


# A mixture-of-experts router, by name or as llm-compressor's pattern ("re:.*mlp.gate$").
_ROUTER = re.compile(r"(mlp|block_sparse_moe)\\?\.gate\$?$")


def _check_ignored(ignored: list[str]) -> None:
    """Only the LM head and the routers may be listed: our one linear method serves every
    decoder layer (the LM head, embeddings and routers are never quantized here)."""
    others = [n for n in ignored if not n.endswith("lm_head") and not _ROUTER.search(n)]
    if others:
        raise ValueError(
            f"checkpoint leaves layers {others[:4]} unquantized; pdserve supports FP8 "
            "checkpoints that quantize every decoder linear layer"
        )
