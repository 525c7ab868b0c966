"""On a GPU: greedy output of a tiny random model in float32 equals HF transformers on the same
GPU, for every attention backend available there, with CUDA graphs and eagerly. Skipped (and
reported as skipped) on machines without CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from common import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") else [])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    folder = tmp_path_factory.mktemp("gpu-qwen2")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_cuda(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_greedy_on_gpu_equals_hf_in_float32(model_dir, hf_cuda, backend, enforce_eager):
    llm = LLM(
        str(model_dir),
        device="cuda",
        dtype="float32",
        attention_backend=backend,
        enforce_eager=enforce_eager,
        max_num_seqs=16,
        kv_cache_memory_bytes=256 << 20,
    )
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 15, 16, 17, 33, 100, 200)
    ]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt], device="cuda")
        expected = hf_cuda.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert out.token_ids == expected
    assert (llm.engine.worker.runner.graphs is None) == enforce_eager
