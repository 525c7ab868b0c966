"""Random checkpoints for `benchmarks/bench_spec.py`, written where the benchmark runs (no
internet there): a draft model of a real config (transformers `from_config` + `save_pretrained`)
and an EAGLE-3 head in its published layout (config.json with `LlamaForCausalLMEagle3`, one
`model.safetensors`; see `common/model/eagle3.py` for the tensors), plus config-only targets
for dummy weights and the tiny configs of the CPU smoke run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CONFIGS = Path(__file__).resolve().parent / "configs"

# Qwen2.5-0.5B-Instruct's config.json (the shapes; its vocabulary, 151936 rows, is smaller
# than Qwen2.5-7B's 152064: the same tokenizer, padded differently).
QWEN25_05B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "use_sliding_window": False,
}
EAGLE3_LLAMA31_8B_DRAFT_VOCAB = 32000  # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B

_TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
TINY_QWEN_TARGET = {**_TINY, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                    "num_hidden_layers": 2, "vocab_size": 512, "rope_theta": 10000.0}  # fmt: skip
TINY_QWEN_DRAFT = {**TINY_QWEN_TARGET, "hidden_size": 32, "intermediate_size": 64,
                   "num_hidden_layers": 1, "vocab_size": 500}  # fmt: skip
# EAGLE-3 reads target layers 2, n/2 and n-3: they must ascend, so n >= 8.
TINY_LLAMA_TARGET = {**_TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                     "num_hidden_layers": 8, "vocab_size": 512, "rope_theta": 10000.0}  # fmt: skip
TINY_DRAFT_VOCAB = 64


def read_config(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "config.json").read_text())


def write_config(directory: Path, config: dict[str, Any]) -> Path:
    """A config-only model directory (for `load_format="dummy"`)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def write_draft(
    directory: Path, config: dict[str, Any], dtype: torch.dtype, device: torch.device
) -> Path:
    """Random weights of `config` in `dtype`, created on `device`, saved with transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.save_pretrained(directory)
    return directory


def eagle3_config(target: dict[str, Any], draft_vocab_size: int) -> dict[str, Any]:
    """The published head config for `target`: one Llama layer of the target's width."""
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "max_position_embeddings": 2048,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "rms_norm_eps", "rope_theta", "rope_scaling", "vocab_size", "hidden_act",
                "bos_token_id", "eos_token_id"):  # fmt: skip
        if key in target:
            config[key] = target[key]
    return config


def write_eagle3_head(
    directory: Path,
    target: dict[str, Any],
    draft_vocab_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> Path:
    """A random EAGLE-3 head for `target` (its config.json as a dict): N(0, 0.02) matrices,
    norms of 1, no `embed_tokens` (the target's is used), draft id d meaning target id
    d * (V // draft_vocab_size)."""
    from safetensors.torch import save_file

    config = eagle3_config(target, draft_vocab_size)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    g = torch.Generator(device=device).manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * 0.02).to(dtype).cpu()

    def ones() -> torch.Tensor:
        return torch.ones(h, dtype=dtype)

    p = "midlayer."
    stride = vocab // draft_vocab_size
    ids = torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids * stride] = True
    tensors = {
        "fc.weight": w(h, 3 * target["hidden_size"]),
        p + "input_layernorm.weight": ones(),
        p + "hidden_norm.weight": ones(),
        p + "post_attention_layernorm.weight": ones(),
        p + "self_attn.q_proj.weight": w(q, 2 * h),
        p + "self_attn.k_proj.weight": w(kv, 2 * h),
        p + "self_attn.v_proj.weight": w(kv, 2 * h),
        p + "self_attn.o_proj.weight": w(h, q),
        p + "mlp.gate_proj.weight": w(inter, h),
        p + "mlp.up_proj.weight": w(inter, h),
        p + "mlp.down_proj.weight": w(h, inter),
        "norm.weight": ones(),
        "lm_head.weight": w(draft_vocab_size, h),
        "d2t": ids * (stride - 1),
        "t2d": t2d,
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory
