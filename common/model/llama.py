"""One compact implementation of the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2)
and its mixture-of-experts members (Qwen3-MoE, Mixtral).

Variants differ only by flags in `ModelSpec`: QKV bias (Qwen2), per-head q/k RMSNorm (Qwen3),
llama3 rope scaling, tied embeddings, and `spec.moe`: a layer's MLP is then a `MoEBlock`
(`common.model.layers.moe`) unless the spec lists it dense. Q/K/V and gate/up are fused into
single matmuls (`PACKED_MODULES` says which checkpoint tensors each stacks); experts are stacked
per layer (`expert_target` maps each published per-expert tensor to its place).
The model sees attention only through `ForwardContext`; it never imports a backend.
Each op that feeds a linear layer gets that layer's `input_quant`: with FP8 linears the norms,
SiLU-and-mul and the attention output hand them `Fp8Activation`s, quantized in the same kernel.

Tensor parallelism (`common.model.parallel`): the model is built from the full `ModelSpec` and
a `TPGroup`; its layers hold this rank's slice (`common.model.layers.linear`, `.vocab`) and
cut it out of the full checkpoint tensors themselves. With one rank the collectives are
no-ops and the model is the plain one.

Pipeline parallelism: a stage's model (`StageLayers`) builds only its decoder layers (the
others are `MissingLayer`s, so checkpoint names keep their indices), the embedding on the first
stage, the final norm and LM head on the last; loading skips every tensor of another stage. A
stage after the first is fed the (hidden, residual) pair its predecessor returned (`carry`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from common.model.attention.base import ForwardContext
from common.model.distributed import TPGroup
from common.model.layers.basic import RMSNorm, RotaryEmbedding, quantize, silu_and_mul
from common.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from common.model.layers.moe import GATE, UP, Experts, MoEBlock
from common.model.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from common.model.layers.weights import default_weight_loader
from common.model.parallel import StageLayers, rank_spec
from common.model.quantization import LinearMethod, expert_quant_for
from common.model.quantization.activation import Fp8Activation
from common.model.spec import ModelSpec

# our fused module -> the checkpoint modules stacked in it, in shard order
PACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


KV_SCALES = ("self_attn.k_scale", "self_attn.v_scale")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

Carry = tuple[torch.Tensor, torch.Tensor]  # (hidden, residual) between pipeline stages


def layer_index(name: str) -> int:
    """The decoder layer a checkpoint tensor belongs to, or -1."""
    match = _LAYER.match(name)
    return -1 if match is None else int(match.group(1))


# A published expert tensor's projection name -> (our stacked parameter, its shard); Mixtral
# names them w1 (gate), w3 (up), w2 (down).
EXPERT_PARTS: dict[str, tuple[str, int]] = {
    "gate_proj": ("gate_up_proj", GATE),
    "up_proj": ("gate_up_proj", UP),
    "down_proj": ("down_proj", 0),
    "w1": ("gate_up_proj", GATE),
    "w3": ("gate_up_proj", UP),
    "w2": ("down_proj", 0),
}
_EXPERT_NAME = re.compile(
    r"^(.*\.experts)\.(\d+)\.(\w+)\.(weight|weight_scale_inv|weight_scale|input_scale)$"
)


def expert_target(name: str) -> tuple[str, tuple[int, int]] | None:
    """`model.layers.3.mlp.experts.7.up_proj.weight` -> (`model.layers.3.mlp.experts.
    gate_up_proj`, (7, UP)); an FP8 checkpoint's `weight_scale` (`weight_scale_inv`) of it ->
    `...experts.gate_up_proj_scale`; an `input_scale` -> `...experts.input_scale` (unused:
    FP8 experts quantize their inputs per token at run time); None for a tensor that is not
    one expert's."""
    match = _EXPERT_NAME.match(name)
    if match is None or match.group(3) not in EXPERT_PARTS:
        return None
    param, shard = EXPERT_PARTS[match.group(3)]
    kind = match.group(4)
    if kind == "input_scale":
        return f"{match.group(1)}.input_scale", (int(match.group(2)), shard)
    suffix = "" if kind == "weight" else "_scale"
    return f"{match.group(1)}.{param}{suffix}", (int(match.group(2)), shard)


def _kv_scale_name(name: str) -> str:
    for proj in ("k", "v"):
        name = name.replace(f"self_attn.{proj}_proj.output_scale", f"self_attn.{proj}_scale")
    return name


class Attention(nn.Module):
    def __init__(
        self, spec: ModelSpec, layer: int, tp: TPGroup, method: LinearMethod | None
    ) -> None:
        super().__init__()
        layout = tp.layout(spec)
        self.layer = layer
        self.num_heads, self.num_kv_heads = layout.heads_per_rank, layout.kv_heads_per_rank
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            spec.hidden_size, spec.head_dim, layout, tp, spec.qkv_bias, method
        )
        self.o_proj = RowParallelLinear(spec.q_size, spec.hidden_size, tp, method=method)
        # FP8 KV-cache scales from the checkpoint (k = stored * k_scale); 1.0 when it has none.
        # Loaded here for the KV-cache step that uses them; nothing reads them yet.
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)

    @property
    def input_quant(self):
        return self.qkv_proj.input_quant

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor | Fp8Activation,
        rotary: RotaryEmbedding,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        rows = (x.data if isinstance(x, Fp8Activation) else x).shape[0]
        qkv = self.qkv_proj(x, ctx.projection_buffer(rows, self.q_size + 2 * self.kv_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k, (self.q_norm, self.k_norm) if self.qk_norm else None)
        return ctx.attention_projected(self.layer, q, k, v, self.project)

    def project(self, attended: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The output projection of the attention's [T, heads, head_dim] result -> [T, hidden]
        (into `out` when given: `ForwardContext.attention_projected`)."""
        attended = attended.reshape(-1, self.q_size)
        return self.o_proj(quantize(attended, self.o_proj.input_quant), out)


class MLP(nn.Module):
    """SiLU-gated MLP; `reduce` off leaves the partial sums to the caller (shared experts)."""

    def __init__(
        self,
        hidden_size: int,
        size: int,
        tp: TPGroup,
        method: LinearMethod | None,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [size, size], tp, method=method)
        self.down_proj = RowParallelLinear(size, hidden_size, tp, reduce=reduce, method=method)

    @property
    def input_quant(self):
        return self.gate_up_proj.input_quant

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.down_proj.input_quant))


def feed_forward(
    spec: ModelSpec, layer: int, tp: TPGroup, method: LinearMethod | None
) -> MLP | MoEBlock:
    """Layer `layer`'s MLP: the experts of `spec.moe` (with any shared experts), or dense."""
    moe = spec.moe
    if moe is None or not moe.is_sparse(layer):
        return MLP(spec.hidden_size, spec.intermediate_size, tp, method)
    shared = None
    if moe.shared_intermediate_size:
        shared = MLP(spec.hidden_size, moe.shared_intermediate_size, tp, method, reduce=False)
    return MoEBlock(moe, spec.hidden_size, tp, shared, expert_quant_for(method))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP; `attention` is the attention module's class (DeepSeek's
    `MLAttention`), called as `Attention` is."""

    def __init__(
        self,
        spec: ModelSpec,
        layer: int,
        tp: TPGroup,
        method: LinearMethod | None,
        attention: type[nn.Module] = Attention,
    ) -> None:
        super().__init__()
        self.self_attn = attention(spec, layer, tp, method)
        self.mlp = feed_forward(spec, layer, tp, method)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, positions, hidden, residual, rotary, ctx):
        quant = self.self_attn.input_quant
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, quant=quant)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, quant)
        hidden = self.self_attn(positions, hidden, rotary, ctx)
        quant = self.mlp.input_quant
        hidden, residual = self.post_attention_layernorm(hidden, residual, quant)
        return self.mlp(hidden), residual


class MissingLayer(nn.Module):
    """Another pipeline stage's decoder layer: no weights here."""


class LlamaModel(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        max_positions: int,
        tp: TPGroup,
        method: LinearMethod | None,
        attention: type[nn.Module] = Attention,
        stage: StageLayers | None = None,
    ) -> None:
        super().__init__()
        self.stage = stage = stage or StageLayers.whole(spec.num_layers)
        self.embed_tokens = None
        if stage.is_first:
            self.embed_tokens = VocabParallelEmbedding(tp.layout(spec), spec.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, tp, method, attention) if i in stage.layers else MissingLayer()
            for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps) if stage.is_last else None
        self.rotary = RotaryEmbedding(spec.rotary_dim, max_positions, spec.rope)
        # EAGLE-3 (opt-in): ids i in 0..num_layers, ascending, of the residual stream a forward
        # leaves in `aux_hidden` (layer i's input; num_layers: the last layer's output before
        # the final norm), concatenated per token row: [T, len * hidden_size].
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        carry: Carry | None = None,
    ) -> torch.Tensor | Carry:
        """The final hidden states (last stage), else the (hidden, residual) carry for the
        next stage. A stage after the first reads `carry`, not `input_ids`."""
        if carry is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = carry
        aux: list[torch.Tensor] = []
        for i in self.stage.layers:
            if i in self.aux_hidden_layers:
                aux.append(hidden if residual is None else hidden + residual)
            hidden, residual = self.layers[i](positions, hidden, residual, self.rotary, ctx)
        if len(self.layers) in self.aux_hidden_layers:
            aux.append(hidden + residual)
        if aux:
            self.aux_hidden = torch.cat(aux, dim=-1)
        if self.norm is None:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """`forward` returns final hidden states for every token; `compute_logits` projects rows.

    Built from the full `spec` for rank `tp.rank` (default: one rank); `self.spec` is the
    rank's (`rank_spec`: its heads, KV heads and MLP slice), which the KV pool is sized by.
    `linear_method` computes every linear layer but the LM head (default: unquantized).
    Subclasses change the attention module (`attention`) and the fused checkpoint tensors
    (`packed_modules`)."""

    packed_modules = PACKED_MODULES
    attention: type[nn.Module] = Attention

    def __init__(
        self,
        spec: ModelSpec,
        max_positions: int,
        tp: TPGroup | None = None,
        linear_method: LinearMethod | None = None,
        stage: StageLayers | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp = tp or TPGroup.single()
        layout = tp.layout(spec)
        self.spec = rank_spec(spec, layout)
        self.stage = stage = stage or StageLayers.whole(spec.num_layers)
        # The dtype the model was built in (build_model sets it as the default): what its
        # activations, and a KV pool in the model dtype, use.
        self.dtype = torch.get_default_dtype()
        self.model = LlamaModel(spec, max_positions, tp, linear_method, self.attention, stage)
        self.lm_head = ParallelLMHead(layout, spec.hidden_size, tp) if stage.is_last else None
        if spec.tie_word_embeddings and stage.is_whole:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        carry: Carry | None = None,
    ) -> torch.Tensor | Carry:
        return self.model(input_ids, positions, ctx, carry)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits of `hidden`'s rows, written into `out` ([rows, vocab] float32) when
        given: captured graphs of every size share one output buffer. Every rank calls it:
        with several ranks each projects its vocabulary rows and the logits are gathered."""
        return self.lm_head.compute_logits(hidden, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full tensors, in checkpoint names (`...q_proj.weight`) or ours (a whole fused
        `...qkv_proj.weight`), each through its parameter's `weight_loader`; the linear
        method's parameters (FP8 `weight_scale`, `input_scale`, ...) load alike. A name with no
        parameter, a wrong shape, or a parameter left unloaded is a ValueError. KV-cache scales
        (`self_attn.k_scale`, or `k_proj.output_scale` in older checkpoints) are optional."""
        params = dict(self.named_parameters())
        kv_scales = {n: b for n, b in self.named_buffers() if n.endswith(KV_SCALES)}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue  # inv_freq buffers some checkpoints carry; ours is computed
            if name == "lm_head.weight" and self.spec.tie_word_embeddings:
                continue
            name = self._stage_name(name)
            if name is None:
                continue  # another pipeline stage's tensor
            name = _kv_scale_name(name).replace(".block_sparse_moe.", ".mlp.")  # Mixtral's
            if name in kv_scales:
                if tensor.numel() != 1:
                    raise ValueError(f"KV scale {name!r} has shape {tuple(tensor.shape)}")
                kv_scales[name].fill_(tensor.reshape(()).float())
                continue
            target, shard_id = expert_target(name) or self._packed_target(name)
            if target.endswith(".experts.input_scale"):
                continue  # static: FP8 experts quantize their inputs per token at run time
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {self.spec.architecture}"
                )
            param = params[target]
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"tensor {name!r} {e}") from e
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        for name, module in self.named_modules():
            if isinstance(module, Experts) and module.missing():
                missing.append(f"{name}: {', '.join(module.missing()[:4])}")
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {missing[:8]}")

    def _stage_name(self, name: str) -> str | None:
        """`name` as this stage holds it, or None when another stage does. A last stage
        without the embedding loads a tied LM head from the embedding's tensor."""
        stage = self.stage
        if stage.is_whole:
            return name
        layer = layer_index(name)
        if layer >= 0:
            return name if layer in stage.layers else None
        if name.startswith("model.embed_tokens."):
            if stage.is_first:
                return name
            tied = self.spec.tie_word_embeddings and stage.is_last
            return name.replace("model.embed_tokens.", "lm_head.") if tied else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if stage.is_last else None
        return name

    def _packed_target(self, name: str) -> tuple[str, int | None]:
        for fused, parts in self.packed_modules.items():
            for shard_id, part in enumerate(parts):
                if f".{part}." in name:
                    return name.replace(f".{part}.", f".{fused}."), shard_id
        return name, None
