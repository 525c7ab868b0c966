"""The numbers our model code needs, read once from a Hugging Face config.

`ModelSpec` is frozen and backend-free: the model, the KV cache sizing and the transfer layer
all read it instead of poking at transformers' config objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.model.quantization.config import QuantConfig, parse_quantization_config

# Architecture name -> flags of our one Llama-family implementation.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
}
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rope_type: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes

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
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope=_rope_spec(config),
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=flags["qkv_bias"] or bool(getattr(config, "attention_bias", False)),
            qk_norm=flags["qk_norm"],
            sliding_window=sliding,
            eos_token_ids=eos_token_ids,
            quantization=parse_quantization_config(_as_dict(config, "quantization_config")),
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


def _rope_spec(config: Any) -> RopeSpec:
    # transformers >= 5 folds everything into `rope_parameters`; older configs use
    # `rope_theta` plus an optional `rope_scaling` dict.
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")
    return RopeSpec(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position=int(merged.get("original_max_position_embeddings", 8192)),
    )
