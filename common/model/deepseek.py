"""DeepSeek-V2 and -V3: the Llama-family decoder (`common.model.llama`) with multi-head latent
attention (MLA, `MLAttention`) and mixture-of-experts MLPs with shared experts.

MLA (spec: `MLASpec`). Queries come from `q_proj`, or from the LoRA `q_a_proj` ->
`q_a_layernorm` -> `q_b_proj` (V3, V2 full size); each head's query has a non-rotary part
(qk_nope_head_dim) and a rotary part (qk_rope_head_dim). `kv_a_proj_with_mqa` computes per
token a latent (kv_lora_rank, normalized by `kv_a_layernorm`) and one rotary key shared by
every head; only these two are cached (`ForwardContext.latent_attention`). `kv_b_proj` maps the
latent to each head's non-rotary key and value; the attention backend uses it in absorbed form
(`LatentProjection`): no per-head key or value is ever materialised for decode.

FP8 checkpoints (DeepSeek-V3's own 128x128 blocks, or any format `common.model.quantization`
reads): every linear layer takes the checkpoint's method, and the experts its `Fp8Experts`,
except `kv_b_proj`. The attention folds that one into its kernels as a plain 16-bit weight, so
its FP8 tensor is dequantized at load with its scale (`dequantize_kv_b_proj`), as vLLM does
for its absorbed weights; its input, the latent, is never quantized.

Tensor parallelism: heads split over ranks (`q_proj` / `q_b_proj` and `kv_b_proj`
column-parallel by heads, `o_proj` row-parallel); `q_a_proj` and `kv_a_proj_with_mqa` are whole
on every rank, so each rank computes and caches the whole latent. Feed-forward per layer is
`llama.feed_forward`: dense for `spec.moe.dense_layers` (V2/V3's first_k_dense_replace), else a
`MoEBlock` whose checkpoint names are `mlp.experts.N.*`, `mlp.shared_experts.*`,
`mlp.gate.weight` and (V3) `mlp.gate.e_score_correction_bias`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from common.model.attention.base import ForwardContext, LatentProjection
from common.model.distributed import TPGroup
from common.model.layers.basic import RMSNorm, RotaryEmbedding, quantize
from common.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from common.model.llama import LlamaForCausalLM, layer_index
from common.model.parallel import StageLayers
from common.model.quantization import LinearMethod
from common.model.quantization.fp8_ops import FP8, dequantize_weight
from common.model.spec import ModelSpec

# DeepSeek's reference code builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps,
# not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def replicated_linear(
    input_size: int, output_size: int, bias: bool, method: LinearMethod | None
) -> ColumnParallelLinear:
    """A linear layer every rank holds whole (a one-rank column-parallel layer)."""
    return ColumnParallelLinear(input_size, output_size, TPGroup.single(), bias, method)


class MLAttention(nn.Module):
    """One layer's multi-head latent attention over this rank's heads (module docstring)."""

    def __init__(
        self, spec: ModelSpec, layer: int, tp: TPGroup, method: LinearMethod | None
    ) -> None:
        super().__init__()
        mla = spec.mla
        assert mla is not None, "MLAttention needs spec.mla"
        self.mla, self.layer = mla, layer
        self.num_heads = tp.layout(spec).heads_per_rank
        hidden, heads, bias = spec.hidden_size, spec.num_heads, spec.qkv_bias
        q_size = heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_size, tp, method=method)
        else:
            self.q_a_proj = replicated_linear(hidden, mla.q_lora_rank, bias, method)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, q_size, tp, method=method)
        self.kv_a_proj_with_mqa = replicated_linear(hidden, mla.cache_dim, bias, method)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        # Read as a plain weight by `projection`, never through a linear method.
        self.kv_b_proj = ColumnParallelLinear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), tp
        )
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, hidden, tp, bias, method=method)

    @property
    def input_quant(self):
        return self.kv_a_proj_with_mqa.input_quant

    def projection(self) -> LatentProjection:
        """This rank's heads of `kv_b_proj`, split into the key and value maps (views)."""
        mla = self.mla
        w = self.kv_b_proj.weight.view(
            self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank
        )
        return LatentProjection(w[:, : mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim :])

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        rotary: RotaryEmbedding,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        mla = self.mla
        if mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q_a = self.q_a_layernorm(self.q_a_proj(x), quant=self.q_b_proj.input_quant)
            q = self.q_b_proj(q_a)
        q = q.view(-1, self.num_heads, mla.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent)
        q_pe, k_pe = rotary(positions, q_pe, k_pe.unsqueeze(1))
        out = ctx.latent_attention(
            self.layer, q_nope, q_pe, latent, k_pe.squeeze(1), self.projection()
        )
        out = out.reshape(-1, self.num_heads * mla.v_head_dim)
        return self.o_proj(quantize(out, self.o_proj.input_quant))


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` with `MLAttention`; the same embedding, norms, LM head, feed-forward
    and checkpoint loading (an FP8 `kv_b_proj` dequantized first: module docstring)."""

    attention = MLAttention
    packed_modules = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(
        self,
        spec: ModelSpec,
        max_positions: int,
        tp: TPGroup | None = None,
        linear_method: LinearMethod | None = None,
        stage: StageLayers | None = None,
    ) -> None:
        if spec.mla is None:
            raise ValueError(f"{spec.architecture}: a DeepSeek model needs an MLA spec")
        super().__init__(spec, max_positions, tp, linear_method, stage)
        config = getattr(linear_method, "config", None)
        self.weight_block = getattr(config, "block", None) or (128, 128)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As `LlamaForCausalLM.load_weights`, skipping the multi-token-prediction layers that
        published V3 checkpoints append after the last decoder layer."""
        num_layers = self.spec.num_layers
        kept = ((n, t) for n, t in weights if layer_index(n) < num_layers)
        super().load_weights(dequantize_kv_b_proj(kept, self.weight_block, self.dtype))


_KV_B_TENSORS = ("weight", "weight_scale_inv", "weight_scale", "input_scale")


def dequantize_kv_b_proj(
    weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` as they come, except each FP8 `kv_b_proj.weight`: held until its scale
    (`weight_scale_inv` or `weight_scale`, in either order) arrives, then yielded dequantized
    to `dtype`. The scale is consumed here, and an `input_scale` dropped: the latent that
    kv_b_proj multiplies is never quantized. A weight or scale left without its partner is a
    ValueError."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, kind = name.rpartition(".")
        if not prefix.endswith(".kv_b_proj") or kind not in _KV_B_TENSORS:
            yield name, tensor
            continue
        if kind == "input_scale":
            continue
        if kind == "weight" and tensor.dtype != FP8:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[kind] = tensor
        if "weight" in parts and len(parts) == 2:
            weight = parts.pop("weight")
            (scale,) = parts.values()
            del pending[prefix]
            try:
                dense = dequantize_weight(weight, scale, block)
            except ValueError as e:
                raise ValueError(f"tensor {prefix}.weight: {e}") from e
            yield f"{prefix}.weight", dense.to(dtype)
    if pending:
        prefix, parts = next(iter(pending.items()))
        raise ValueError(
            f"checkpoint has {prefix}.{next(iter(parts))} without its "
            f"{'scale' if 'weight' in parts else 'FP8 weight'}"
        )


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3 differs in routing (sigmoid scores, correction bias: `MoESpec`) and may rotate
    Neox-style (`rope_interleave` off), both read into the spec."""
