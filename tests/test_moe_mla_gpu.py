"""On a GPU: tiny random Qwen3-MoE, Mixtral and DeepSeek-V2/V3 models in float32 give HF's
greedy tokens through the GPU path users run: the Triton expert kernels (router, plan, grouped
GEMMs), the Triton MLA kernels and the paged latent cache, eagerly and inside the decode and
prefill CUDA graphs, with chunked prefill and prefix-cache hits. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from common import LLM, SamplingParams
from tests.hf_oracle import hf_greedy
from tests.test_architectures_match_hf import CONFIGS as DENSE_AND_MOE
from tests.test_deepseek_matches_hf import CONFIGS as DEEPSEEK
from tests.test_deepseek_matches_hf import VOCAB, build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MODELS = ["qwen3_moe", "mixtral", *sorted(DEEPSEEK)]
MODES = {"eager": dict(enforce_eager=True), "graphs": dict()}
LENGTHS = [1, 17, 33, 100, 200]


@pytest.fixture(scope="module", params=MODELS)
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param in DEEPSEEK:
        hf = build(request.param, folder)
    else:
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(DENSE_AND_MOE[request.param](), dtype=torch.float32)
        hf.save_pretrained(folder)
    return request.param, hf.eval(), folder


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_on_gpu_equals_hf_in_float32(tiny, mode):
    name, hf, folder = tiny
    vocab = VOCAB if name in DEEPSEEK else hf.config.vocab_size
    llm = LLM(
        str(folder), device="cuda", dtype="float32", attention_backend="triton",
        max_num_seqs=8, kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=64,
        **MODES[mode],
    )  # fmt: skip
    batch = prompts(vocab)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # twice: the second pass hits the prefix cache
    for _ in range(2):
        outs = llm.generate(batch, params)
        for prompt, out in zip(batch, outs, strict=True):
            assert out.token_ids == hf_greedy(hf, prompt, 8), (name, len(prompt))
