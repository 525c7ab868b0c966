"""Tiny random configs of the mixture-of-experts families, for CPU smoke runs of the engine
benchmark (`bench_engine.py --smoke --tiny qwen3-moe`): the published config.json keys at toy
sizes, with one dense layer, so every floor term (dense MLP, routed and shared experts, MLA's
latent cache) has something to count. Dummy weights; no tokenizer is needed."""

from __future__ import annotations

import json
from pathlib import Path

_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}
TINY: dict[str, dict] = {
    "qwen3-moe": {
        **_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": 16,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 1000000.0,
    },
    "deepseek-v2": {
        **_COMMON,
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "n_routed_experts": 16,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "topk_method": "greedy",
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 64,  # powers of two, as the MLA kernels want (512 and 64 published)
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "rope_theta": 10000.0,
    },
}


def write_tiny(name: str, dst: Path) -> Path:
    """`dst`/config.json of the tiny `name` config; returns `dst`."""
    if name not in TINY:
        raise ValueError(f"no tiny config {name!r}; known: {', '.join(sorted(TINY))}")
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(TINY[name], indent=1))
    return dst


def unservable(directory: Path) -> str | None:
    """Why this checkout cannot build the model of `directory` (its architecture unparsed or
    without a model class), or None when it can."""
    from common.model.registry import model_class
    from common.model.source import read_spec, resolve_model

    try:
        model_class(read_spec(resolve_model(str(directory))).architecture)
    except ValueError as exc:
        return str(exc)
    return None
