"""Pipeline parallelism inside one node's process group of real rank processes (gloo, CPU,
fp32): greedy output at PP 2 (and PP 2 x TP 2) equals PP 1 and HF transformers `generate()`.

The tiny Llama has an odd layer count (5), split 2 + 3 by an explicit partition and 3 + 2 by
default: each stage holds only its layers' weights and KV, stage 0 the embedding, the last
stage the final norm and LM head. `max_num_batched_tokens` below the longest prompt makes its
chunks flow through the stages back to back.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from common import LLM, SamplingParams
from tests.hf_oracle import hf_greedy
from tests.tiny_models import TINY_SHAPE

COMMON = dict(
    TINY_SHAPE, num_hidden_layers=5, vocab_size=387, max_position_embeddings=512,
    initializer_range=0.25,
)  # fmt: skip
NEW_TOKENS = 8
OPTIONS = dict(device="cpu", block_size=16, max_num_batched_tokens=32, num_kv_blocks=64)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, 387, (n,), generator=g).tolist() for n in (1, 21, 70)]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def generate(model: str, **options) -> list[list[int]]:
    with LLM(model, **{**OPTIONS, **options}) as llm:
        return [out.token_ids for out in llm.generate(prompts(), greedy())]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pp_llama")
    torch.manual_seed(0)
    config = LlamaConfig(**COMMON, tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(folder)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts()]
    return str(folder), expected


@pytest.mark.parametrize("partition", [None, "2,3"])
def test_greedy_at_pp2_equals_pp1_and_hf(llama, partition):
    folder, expected = llama
    assert generate(folder, pp=1) == expected
    assert generate(folder, pp=2, pp_layer_partition=partition) == expected


def test_pp2_by_tp2_equals_tp1(llama):
    folder, expected = llama
    assert generate(folder, pp=2, tp=2) == expected


def test_tied_dummy_weights_at_pp2_equal_pp1(tmp_path):
    """The last stage loads its LM head from the embedding's tensor, which stage 0 holds."""
    (tmp_path / "config.json").write_text(
        Qwen2Config(**COMMON, tie_word_embeddings=True).to_json_string()
    )
    options = dict(load_format="dummy", seed=7)
    assert generate(str(tmp_path), pp=2, **options) == generate(str(tmp_path), **options)
