"""The EAGLE-3 draft head, in its published checkpoint layout (config.json with architectures
`LlamaForCausalLMEagle3`, as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B and the SGLang- and
vLLM-trained heads).

The math, per token row at position p:
    h      = fc(aux)             aux: the target's residual stream at 3 layers, [3 * H_target]
                                 (a later draft step feeds the head's own `prenorm` instead)
    x      = cat(input_layernorm(embed(token)), hidden_norm(h))           [2H]
    a      = o_proj(attention(q, k, v of x, rotary at p)) + h
    out    = mlp(post_attention_layernorm(a)) + a                         = `prenorm`
    logits = lm_head(norm(out))                                           [draft_vocab]
and a draft id d means target id d + d2t[d]. `norm_before_residual` heads add hidden_norm(h)
instead of h. The row for position p pairs the target's hidden state at p with the token at
p + 1 and predicts the token at p + 2. Without `embed_tokens` in the checkpoint the head uses
the target's embedding.

Checkpoint tensors: `fc.weight` [H, 3H_t], `midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight`, `midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v read
2H), `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`, `lm_head.weight`
[draft_vocab, H], `d2t` [draft_vocab], `t2d` (unused), optionally `embed_tokens.weight`.
The head runs on one rank; its one attention layer is layer 0 of its own KV pool.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from common.model.attention.base import ForwardContext
from common.model.distributed import TPGroup
from common.model.layers.basic import RMSNorm, RotaryEmbedding
from common.model.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    process_weights_after_loading,
)
from common.model.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from common.model.layers.weights import copy_checked, default_weight_loader
from common.model.llama import MLP, PACKED_MODULES, Attention
from common.model.loader import iter_safetensors, safetensors_names
from common.model.parallel import TPLayout
from common.model.spec import ModelSpec

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# HF LlamaConfig defaults for keys a head's config.json may leave out.
_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048}


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers whose input EAGLE-3 reads by default: early, middle, late."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Eagle3Spec:
    layer: ModelSpec  # the midlayer's shapes; vocab_size is the target's (the embedding's)
    draft_vocab_size: int
    target_hidden_size: int
    # `eagle_config.eagle_aux_hidden_state_layer_ids`: target layers whose *output* it reads
    aux_output_layers: tuple[int, ...] | None
    norm_before_residual: bool
    num_midlayers: int

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> Eagle3Spec:
        archs = raw.get("architectures") or []
        if not any(a in EAGLE3_ARCHITECTURES for a in archs):
            raise ValueError(
                f"not an EAGLE-3 head: architectures {archs}, expected one of {EAGLE3_ARCHITECTURES}"
            )
        config = SimpleNamespace(**{**_DEFAULTS, **raw, "architectures": ["LlamaForCausalLM"]})
        eagle = raw.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            layer=ModelSpec.from_hf_config(config),
            draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            target_hidden_size=int(raw.get("target_hidden_size") or raw["hidden_size"]),
            aux_output_layers=None if ids is None else tuple(int(i) for i in ids),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            num_midlayers=int(raw.get("num_hidden_layers", 1)),
        )

    def aux_layers(self, target_num_layers: int) -> tuple[int, ...]:
        """`LlamaModel.aux_hidden_layers` for a target of `target_num_layers` layers."""
        if self.aux_output_layers is None:
            layers = default_aux_layers(target_num_layers)
        else:
            layers = tuple(i + 1 for i in self.aux_output_layers)  # output of i = input of i+1
        if (
            list(layers) != sorted(set(layers))
            or not 0 <= layers[0] <= layers[-1] <= target_num_layers
        ):
            raise ValueError(
                f"EAGLE-3 aux layers {layers} must ascend within 0..{target_num_layers} "
                f"(the target's layers)"
            )
        return layers


class Eagle3Layer(nn.Module):
    """The head's one decoder layer ("midlayer"): q/k/v read the normed embedding and the
    normed hidden state side by side."""

    def __init__(self, spec: Eagle3Spec, tp: TPGroup) -> None:
        super().__init__()
        layer = spec.layer
        self.self_attn = Attention(layer, 0, tp, None)
        # Llama attention reads H inputs; this one 2H.
        self.self_attn.qkv_proj = QKVParallelLinear(
            2 * layer.hidden_size, layer.head_dim, tp.layout(layer), tp, layer.qkv_bias
        )
        self.mlp = MLP(layer.hidden_size, layer.intermediate_size, tp, None)
        eps = layer.rms_norm_eps
        self.input_layernorm = RMSNorm(layer.hidden_size, eps)
        self.hidden_norm = RMSNorm(layer.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(layer.hidden_size, eps)
        self.norm_before_residual = spec.norm_before_residual

    def forward(self, positions, embeds, hidden, rotary, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        attn = self.self_attn(positions, x, rotary, ctx)
        x, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    """`combine` turns the target's aux hidden states into the head's hidden size; `forward`
    returns (normed, prenorm) per row: logits come from `normed`, the next draft step is fed
    `prenorm`. `compute_logits` gives draft-vocabulary logits, `to_target` maps their ids."""

    packed_modules = PACKED_MODULES

    def __init__(
        self,
        spec: Eagle3Spec,
        max_positions: int,
        target_embedding: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        if spec.num_midlayers != 1:
            raise ValueError(f"EAGLE-3 heads have one midlayer, this config {spec.num_midlayers}")
        tp, layer = TPGroup.single(), spec.layer
        self.spec = spec
        hidden = layer.hidden_size
        self.fc = ColumnParallelLinear(3 * spec.target_hidden_size, hidden, tp)
        self.midlayer = Eagle3Layer(spec, tp)
        self.norm = RMSNorm(hidden, layer.rms_norm_eps)
        self.rotary = RotaryEmbedding(layer.head_dim, max_positions, layer.rope)
        draft_layout = TPLayout.of(layer, 1)
        self.lm_head = ParallelLMHead(
            TPLayout(1, layer.num_heads, layer.num_kv_heads, layer.intermediate_size,
                     spec.draft_vocab_size),
            hidden,
            tp,
        )  # fmt: skip
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.int64))
        embed: Callable[[torch.Tensor], torch.Tensor] | None = target_embedding
        if embed is None:
            self.embed_tokens = embed = VocabParallelEmbedding(draft_layout, hidden, tp)
        # Not registered as a submodule: the target owns (and loads) its embedding.
        object.__setattr__(self, "embed", embed)

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[T, 3 * H_target] target aux hidden states -> [T, H] head input."""
        return self.fc(aux_hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.midlayer(positions, self.embed(input_ids), hidden, self.rotary, ctx)
        return self.norm(x, residual)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """float32 [rows, draft_vocab] logits."""
        return self.lm_head.compute_logits(normed, None)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors (`midlayer.` or `layers.0.`), each through its layer's loader;
        a name with no place, a wrong shape or a missing tensor is a ValueError."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        has_d2t = False
        for name, tensor in weights:
            name = name.removeprefix("model.").replace("layers.0.", "midlayer.")
            if name == "t2d" or "rotary_emb" in name:
                continue
            if name == "d2t":
                copy_checked(self.d2t, tensor.to(torch.int64))
                has_d2t = True
                continue
            target, shard_id = self._packed_target(name)
            if target not in params:
                raise ValueError(f"EAGLE-3 checkpoint tensor {name!r} has no place in the head")
            param = params[target]
            try:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"tensor {name!r} {e}") from e
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"EAGLE-3 checkpoint is missing tensors: {missing[:8]}")
        if not has_d2t and self.spec.draft_vocab_size != self.spec.layer.vocab_size:
            raise ValueError(
                f"EAGLE-3 checkpoint has no d2t for its draft vocabulary of "
                f"{self.spec.draft_vocab_size} (target vocabulary {self.spec.layer.vocab_size})"
            )
        last = int(self.to_target(torch.arange(len(self.d2t), device=self.d2t.device)).max())
        if last >= self.spec.layer.vocab_size:
            raise ValueError(
                f"d2t maps to id {last}, past the vocabulary {self.spec.layer.vocab_size}"
            )

    def _packed_target(self, name: str) -> tuple[str, int | None]:
        for fused, parts in self.packed_modules.items():
            for shard_id, part in enumerate(parts):
                if f".{part}." in name:
                    return name.replace(f".{part}.", f".{fused}."), shard_id
        return name, None


def read_eagle3_spec(directory: Path) -> Eagle3Spec:
    return Eagle3Spec.from_config(json.loads((directory / "config.json").read_text()))


def load_eagle3_head(
    directory: Path,
    target_spec: ModelSpec,
    target_embedding: Callable[[torch.Tensor], torch.Tensor],
    *,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Eagle3Head:
    """The head in `directory` for a target of `target_spec`; it uses `target_embedding`
    unless the checkpoint ships `embed_tokens.weight`. ValueError naming both sides when the
    head was not made for such a target."""
    spec = read_eagle3_spec(directory)
    layer = spec.layer
    if layer.vocab_size != target_spec.vocab_size:
        raise ValueError(
            f"EAGLE-3 head {directory} has vocab_size {layer.vocab_size}, the target "
            f"{target_spec.vocab_size}"
        )
    if spec.target_hidden_size != target_spec.hidden_size:
        raise ValueError(
            f"EAGLE-3 head {directory} reads hidden states of size {spec.target_hidden_size}, "
            f"the target's are {target_spec.hidden_size}"
        )
    own_embedding = "embed_tokens.weight" in {
        n.removeprefix("model.") for n in safetensors_names(directory)
    }
    if not own_embedding and layer.hidden_size != target_spec.hidden_size:
        raise ValueError(
            f"EAGLE-3 head {directory} has hidden size {layer.hidden_size} and no embed_tokens; "
            f"the target's embedding is {target_spec.hidden_size} wide"
        )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = Eagle3Head(spec, max_positions, None if own_embedding else target_embedding)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        head.load_weights(iter_safetensors(directory))
        process_weights_after_loading(head)
    return head.eval()
