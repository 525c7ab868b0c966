"""Checkpoint forms: sharded safetensors with an index, dummy weights from a config alone,
unsupported architectures, and the embedded model's install hint."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from common import LLM, SamplingParams
from common.model.embedded import INSTALL_COMMAND, EmbeddedModelMissing, embedded_gguf_path
from tests.hf_oracle import hf_greedy

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.25,
)


def test_sharded_safetensors_with_index_load_and_match_hf(tmp_path):
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(
        LlamaConfig(**CONFIG, tie_word_embeddings=False), dtype=torch.float32
    ).eval()
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    ours = LLM(str(tmp_path), device="cpu")
    prompt = list(range(5, 30))
    out = ours.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 10)


def test_dummy_weights_need_only_a_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                **CONFIG,
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "rms_norm_eps": 1e-5,
                "max_position_embeddings": 256,
            }
        )
    )
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu")
    out = llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and all(0 <= t < 256 for t in out.token_ids)


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**CONFIG, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(tmp_path), load_format="dummy", device="cpu")


def test_missing_embedded_package_error_gives_the_install_command():
    with pytest.raises(EmbeddedModelMissing, match=INSTALL_COMMAND.replace("-", r"\-")):
        embedded_gguf_path(package="no_such_embedded_model_package")
