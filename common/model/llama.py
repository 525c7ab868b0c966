"""One compact implementation of the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2).

Variants differ only by flags in `ModelSpec`: QKV bias (Qwen2), per-head q/k RMSNorm (Qwen3),
llama3 rope scaling, tied embeddings. Q/K/V and gate/up are fused into single matmuls; the
loader splices the checkpoint's separate tensors into them (`STACKED_PARAMS`).
The model sees attention only through `ForwardContext`; it never imports a backend.

Tensor parallelism (`common.model.parallel`): the model is built from one rank's `ModelSpec`
(`rank_spec`: its heads, KV heads and MLP slice) and a `TPGroup`. o_proj and down_proj are
row-parallel and all-reduce their partial sums; the embedding and the LM head are
vocab-parallel (`VocabParallelEmbedding`, `ParallelLMHead`). With one rank the collectives are
no-ops and the model is the plain one.
"""

from __future__ import annotations

import torch
from torch import nn

from common.model.attention.base import ForwardContext
from common.model.distributed import TPGroup
from common.model.layers.basic import RMSNorm, RotaryEmbedding, silu_and_mul
from common.model.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from common.model.spec import ModelSpec

# (our fused parameter, checkpoint parameter, shard index within the fused one)
STACKED_PARAMS: tuple[tuple[str, str, int], ...] = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer, self.tp = layer, tp
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
        )
        self.q_size, self.kv_size = spec.q_size, spec.kv_size
        self.qkv_proj = nn.Linear(
            spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=False)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)

    def shard_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = ctx.attention(self.layer, q, k, v)
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def shard_sizes(self) -> list[int]:
        return [self.intermediate_size, self.intermediate_size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer, tp)
        self.mlp = MLP(spec, tp)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, positions, hidden, residual, rotary, ctx):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, rotary, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, max_positions: int, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, tp) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec.head_dim, max_positions, spec.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext):
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, self.rotary, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """`forward` returns final hidden states for every token; `compute_logits` projects rows.

    `spec` is this rank's (`common.model.parallel.rank_spec`); `tp` the node's ranks (default: one)."""

    def __init__(self, spec: ModelSpec, max_positions: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp = tp or TPGroup.single()
        self.model = LlamaModel(spec, max_positions, tp)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, tp)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext):
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits of `hidden`'s rows, written into `out` ([rows, vocab] float32) when
        given: captured graphs of every size share one output buffer. Every rank calls it:
        with several ranks each projects its vocabulary rows and the logits are gathered."""
        return self.lm_head.compute_logits(hidden, out)
