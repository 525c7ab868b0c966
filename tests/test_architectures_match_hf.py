"""Tiny random models of every supported architecture: greedy output equals HF `generate()`.

Each model is built by transformers from a config, saved as a real HF directory (config.json +
safetensors) and loaded by our loader, so the weight mapping is exercised too.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from common import LLM, SamplingParams
from tests.hf_oracle import hf_greedy

COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    initializer_range=0.25,
)
CONFIGS = {
    "llama3_gqa_untied": lambda: LlamaConfig(
        **COMMON,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rope_theta=500000.0,
    ),
    "llama_mqa_tied": lambda: LlamaConfig(
        **COMMON, num_key_value_heads=1, tie_word_embeddings=True
    ),
    "mistral": lambda: MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=None),
    "qwen2_qkv_bias": lambda: Qwen2Config(
        **COMMON, num_key_value_heads=2, tie_word_embeddings=False
    ),
    "qwen3_qk_norm": lambda: Qwen3Config(
        **COMMON, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True
    ),
    # Experts: 8 of them, 2 per token; layer 1 of Qwen3-MoE's 3 is dense (mlp_only_layers).
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": 3},
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    ),
    "mixtral": lambda: MixtralConfig(
        **COMMON,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
    ),
}
PROMPT_LENGTHS = [1, 15, 16, 17, 33, 100]
NEW_TOKENS = 12


def random_prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, COMMON["vocab_size"], (length,), generator=g).tolist()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny_model(request, tmp_path_factory):
    torch.manual_seed(0)
    config = CONFIGS[request.param]()
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    ours = LLM(str(folder), device="cpu", block_size=16, max_num_batched_tokens=256)
    return request.param, hf, ours


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_architecture_is_recognised(tiny_model):
    name, hf, ours = tiny_model
    assert ours.engine.worker.spec.architecture == hf.config.architectures[0]


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_greedy_equals_hf_at_block_boundaries(tiny_model, length):
    _, hf, ours = tiny_model
    prompt = random_prompt(length, seed=length)
    assert ours.generate(prompt, greedy())[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)


def test_batch_of_mixed_lengths_equals_hf_per_prompt(tiny_model):
    _, hf, ours = tiny_model
    prompts = [random_prompt(n, seed=100 + n) for n in PROMPT_LENGTHS]
    outputs = ours.generate(prompts, greedy())
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, NEW_TOKENS)


def test_prefix_cache_hit_gives_hf_output(tiny_model):
    _, hf, ours = tiny_model
    shared = random_prompt(48, seed=7)
    first = shared + random_prompt(5, seed=8)
    second = shared + random_prompt(9, seed=9)
    ours.generate(first, greedy())
    out = ours.generate(second, greedy())[0]
    assert out.num_cached_tokens >= 48
    assert out.token_ids == hf_greedy(hf, second, NEW_TOKENS)


def test_chunked_prefill_gives_hf_output(tmp_path):
    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(CONFIGS["qwen2_qkv_bias"](), dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    # A 150-token prompt under a 40-token step budget runs as four chunks.
    ours = LLM(str(tmp_path), device="cpu", max_num_batched_tokens=40, enable_prefix_caching=False)
    prompt = random_prompt(150, seed=11)
    assert ours.generate(prompt, greedy())[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)


def test_request_alone_equals_same_request_in_batch_of_16(tiny_model):
    _, _, ours = tiny_model
    prompts = [random_prompt(5 + 7 * i, seed=200 + i) for i in range(16)]
    alone = ours.generate(prompts[5], greedy(20))[0].token_ids
    batched = ours.generate(prompts, greedy(20))
    assert batched[5].token_ids == alone


def test_preemption_under_a_tiny_kv_pool_keeps_outputs_exact(tmp_path):
    torch.manual_seed(2)
    hf = AutoModelForCausalLM.from_config(CONFIGS["llama_mqa_tied"](), dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    roomy = LLM(str(tmp_path), device="cpu")
    tight = LLM(str(tmp_path), device="cpu", num_kv_blocks=12, block_size=16)
    prompts = [random_prompt(30 + i, seed=300 + i) for i in range(6)]
    expected = [o.token_ids for o in roomy.generate(prompts, greedy(40))]
    got = tight.generate(prompts, greedy(40))
    assert [o.token_ids for o in got] == expected
    assert tight.engine.worker.allocator.stats().num_used == 0
