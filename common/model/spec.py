"""The numbers our model code needs, read once from a Hugging Face config.

`ModelSpec` is frozen and backend-free: the model, the KV cache sizing and the transfer layer
all read it instead of poking at transformers' config objects. A mixture-of-experts model adds
a `MoESpec` (Qwen3-MoE, Mixtral, DeepSeek); DeepSeek's multi-head latent attention an
`MLASpec`, which changes what the KV cache holds per token (`kv_cache_geometry`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from common.model.quantization.config import QuantConfig, parse_quantization_config

# Architecture name -> attention flags (the Llama family's; DeepSeek's attention is MLA).
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
    "Qwen3MoeForCausalLM": {"qkv_bias": False, "qk_norm": True},
    "MixtralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "DeepseekV2ForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "DeepseekV3ForCausalLM": {"qkv_bias": False, "qk_norm": False},
}
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP: a gate scores `num_experts` experts per token, the `top_k`
    best run (SiLU-gated MLPs of `intermediate_size`) and their outputs are summed, weighted.

    Routing, as the published models do it:
    - `scoring` "softmax" (Qwen3-MoE, Mixtral, DeepSeek-V2) or "sigmoid" (DeepSeek-V3);
    - `num_groups` > 1: experts come in groups; only the `topk_groups` best groups (scored by
      `group_score`: "max" of a group's scores, V2; "top2_sum", V3) may be picked;
    - `correction_bias` (V3): a per-expert bias added to the scores for choosing only;
    - `renormalize`: the chosen weights are divided by their sum; then all are multiplied by
      `routed_scaling`.
    `shared_intermediate_size` > 0: a plain MLP every token also runs (DeepSeek's shared
    experts, fused into one). Layers in `dense_layers` have the plain MLP of the model's
    `intermediate_size` instead (DeepSeek's first `first_k_dense_replace`, Qwen3-MoE's
    `mlp_only_layers`)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: str = "softmax"
    renormalize: bool = True
    routed_scaling: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    correction_bias: bool = False
    shared_intermediate_size: int = 0
    dense_layers: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..num_experts {self.num_experts}")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported expert scoring {self.scoring!r}: softmax or sigmoid")
        if self.group_score not in ("max", "top2_sum"):
            raise ValueError(f"unsupported group score {self.group_score!r}: max or top2_sum")
        if self.num_experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(
                f"{self.num_experts} experts in {self.num_groups} groups, "
                f"{self.topk_groups} groups picked: not a valid grouping"
            )

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek's multi-head latent attention. Queries go through a LoRA of rank `q_lora_rank`
    (None: one projection); keys and values are rebuilt from a `kv_lora_rank` latent shared by
    every head, plus one `qk_rope_head_dim` rotary key shared by every head. Each head's query
    and key have `qk_nope_head_dim + qk_rope_head_dim` values, its value `v_head_dim`. The cache
    holds only the latent and the rotary key: `kv_lora_rank + qk_rope_head_dim` per token."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class KVCacheGeometry:
    """What one token of one layer occupies in the KV pool: `planes` tensors (2: K and V;
    1: MLA's latent) of `heads` x `head_dim` values each."""

    planes: int
    heads: int
    head_dim: int

    def describe(self) -> str:
        if self.planes == 1:
            return f"latent {self.heads} x {self.head_dim}"
        return f"K/V {self.heads} heads x {self.head_dim}"


ROPE_TYPES = ("default", "llama3", "yarn")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding: `theta`, and the scaling of `rope_type` with its parameters.

    llama3 uses `factor`, the two `*_freq_factor`s and `original_max_position`. yarn (DeepSeek)
    blends interpolated and original frequencies between the `beta_fast` and `beta_slow`
    rotation counts and scales cos/sin by `attention_factor` (None: derived from `factor`,
    `mscale` and `mscale_all_dim` as transformers does). `interleaved`: rotary pairs are
    adjacent values (x0, x1), (x2, x3), ... (DeepSeek) instead of the two halves (Neox)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: not stated
    mscale_all_dim: float = 0.0  # 0: not stated
    attention_factor: float | None = None
    truncate: bool = True
    interleaved: bool = False

    @property
    def cos_sin_scale(self) -> float:
        """What yarn multiplies cos and sin by (so q.k by its square); 1.0 otherwise."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    quantization: QuantConfig | None = None  # what the checkpoint's weights are stored as
    moe: MoESpec | None = None
    mla: MLASpec | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_cache_geometry(self) -> KVCacheGeometry:
        """One latent "head" for MLA (every tensor-parallel rank holds it whole), else this
        spec's K and V heads."""
        if self.mla is not None:
            return KVCacheGeometry(1, 1, self.mla.cache_dim)
        return KVCacheGeometry(2, self.num_kv_heads, self.head_dim)

    @property
    def rotary_dim(self) -> int:
        """Values of each query and key head the rotary embedding turns (MLA: its rope part)."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def attention_scale(self) -> float:
        """The softmax scale: head_dim^-0.5; MLA's is qk_head_dim^-0.5 (`head_dim` here),
        times yarn's mscale(factor, mscale_all_dim)^2 under a scaled rope (as DeepSeek's
        reference code does, so long-context logits keep their temperature)."""
        scale = self.head_dim**-0.5
        rope = self.rope
        if self.mla is not None and rope.rope_type != "default" and rope.mscale_all_dim:
            scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
        return scale

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        g = self.kv_cache_geometry
        return g.planes * self.num_layers * g.heads * g.head_dim * dtype_bytes

    @classmethod
    def from_hf_config(cls, config: Any, eos_token_ids: tuple[int, ...] = ()) -> ModelSpec:
        archs = list(getattr(config, "architectures", None) or [])
        if not archs:  # GGUF-derived configs carry only model_type
            archs = [MODEL_TYPES.get(getattr(config, "model_type", ""), "")]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = getattr(config, "model_type", "?")
            raise ValueError(
                f"unsupported architecture {archs or model_type!r}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        flags = SUPPORTED_ARCHITECTURES[arch]
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        if arch in DEEPSEEK:  # HF's `head_dim` there is the rotary part only
            head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        sliding = getattr(config, "sliding_window", None)
        if arch.startswith("Qwen") and not getattr(config, "use_sliding_window", False):
            sliding = None
        if not eos_token_ids:
            eos_token_ids = _as_id_tuple(getattr(config, "eos_token_id", None))
        return cls(
            architecture=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            # MLA's cache is one latent "head" every query head reads (and every TP rank holds)
            num_kv_heads=1 if arch in DEEPSEEK else kv_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope=_rope_spec(config, arch),
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=flags["qkv_bias"] or bool(getattr(config, "attention_bias", False)),
            qk_norm=flags["qk_norm"],
            sliding_window=sliding,
            eos_token_ids=eos_token_ids,
            quantization=parse_quantization_config(_as_dict(config, "quantization_config")),
            moe=moe_spec(arch, config),
            mla=_mla_spec(config) if arch in DEEPSEEK else None,
        )


def moe_spec(arch: str, config: Any) -> MoESpec | None:
    """The experts as each family's config.json states them (None: a dense model)."""
    layers = range(config.num_hidden_layers)
    if arch == "MixtralForCausalLM":
        return MoESpec(_num_experts(config), config.num_experts_per_tok, config.intermediate_size)
    if arch == "Qwen3MoeForCausalLM":
        step = getattr(config, "decoder_sparse_step", 1) or 1
        only = set(getattr(config, "mlp_only_layers", None) or [])
        dense = frozenset(i for i in layers if i in only or (i + 1) % step)
        return MoESpec(
            _num_experts(config),
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            dense_layers=dense,
        )
    if arch not in DEEPSEEK:
        return None
    first_dense = getattr(config, "first_k_dense_replace", 0) or 0
    freq = getattr(config, "moe_layer_freq", 1) or 1
    v3 = arch == "DeepseekV3ForCausalLM"
    method = getattr(config, "topk_method", "noaux_tc" if v3 else "greedy")
    grouped = method in ("group_limited_greedy", "noaux_tc")
    scoring = getattr(config, "scoring_func", "sigmoid" if v3 else "softmax")
    shared = getattr(config, "n_shared_experts", 0) or 0
    return MoESpec(
        _num_experts(config),
        config.num_experts_per_tok,
        config.moe_intermediate_size,
        scoring=scoring,
        renormalize=bool(getattr(config, "norm_topk_prob", False)),
        routed_scaling=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
        num_groups=(getattr(config, "n_group", None) or 1) if grouped else 1,
        topk_groups=(getattr(config, "topk_group", None) or 1) if grouped else 1,
        group_score="top2_sum" if method == "noaux_tc" else "max",
        correction_bias=method == "noaux_tc",
        shared_intermediate_size=shared * config.moe_intermediate_size,
        dense_layers=frozenset(i for i in layers if i < first_dense or i % freq),
    )


def _num_experts(config: Any) -> int:
    # Published configs say num_experts (Qwen3-MoE) / n_routed_experts (DeepSeek) /
    # num_local_experts (Mixtral); transformers >= 5 saves num_local_experts for all.
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        value = getattr(config, key, None)
        if value:
            return int(value)
    raise ValueError("a mixture-of-experts config.json must state its number of experts")


def _mla_spec(config: Any) -> MLASpec:
    return MLASpec(
        q_lora_rank=getattr(config, "q_lora_rank", None) or None,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
    )


def _as_dict(config: Any, key: str) -> dict[str, Any] | None:
    value = getattr(config, key, None)
    return value if value is None or isinstance(value, dict) else value.to_dict()


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_spec(config: Any, arch: str = "") -> RopeSpec:
    # transformers >= 5 folds everything into `rope_parameters`; older configs use
    # `rope_theta` plus an optional `rope_scaling` dict.
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    # DeepSeek-V2 rotates adjacent pairs; V3 too unless its config turns `rope_interleave` off.
    interleaved = arch == "DeepseekV2ForCausalLM" or (
        arch == "DeepseekV3ForCausalLM" and getattr(config, "rope_interleave", True) is not False
    )
    if rope_type != "yarn":
        return RopeSpec(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position=int(merged.get("original_max_position_embeddings", 8192)),
            mscale_all_dim=float(merged.get("mscale_all_dim") or 0.0),
            interleaved=interleaved,
        )
    # yarn's defaults as transformers fills them: the pre-training length is the model's
    # unless stated, and a missing factor is the ratio of the two.
    original = int(merged.get("original_max_position_embeddings") or config.max_position_embeddings)
    factor = merged.get("factor") or config.max_position_embeddings / original
    attention_factor = merged.get("attention_factor")
    return RopeSpec(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(factor),
        original_max_position=original,
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        mscale=float(merged.get("mscale") or 0.0),
        mscale_all_dim=float(merged.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(merged.get("truncate", True)),
        interleaved=interleaved,
    )
