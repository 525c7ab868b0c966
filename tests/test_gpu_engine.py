"""On a GPU: greedy output of a tiny random model in float32 equals HF transformers on the same
GPU, for every attention backend available there, eagerly, with decode graphs, with piecewise
prefill/mixed-step graphs too, overlapped and synchronous; seeded sampling gives the same
tokens overlapped and synchronous; the staging ring refuses a rewrite under a running step.
Skipped (and reported as skipped) on machines without CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from common import LLM, SamplingParams
from common.engine.cuda_graphs import StagingHazard, StagingRing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") else [])
# name -> engine options: which steps run as graphs
MODES = {
    "eager": dict(enforce_eager=True),
    "decode-graphs": dict(prefill_graph_max_tokens=0),
    "all-graphs": dict(),  # decode graphs + prefill/mixed graphs up to 1024 tokens
    # 96-token steps: chunks and mixed steps in 64-token graphs, larger ones eager
    "small-buckets": dict(prefill_graph_max_tokens=64, max_num_batched_tokens=96),
}


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


def make_llm(model_dir, backend: str, mode: str, overlap: bool = True) -> LLM:
    options = dict(
        device="cuda",
        dtype="float32",
        attention_backend=backend,
        max_num_seqs=16,
        kv_cache_memory_bytes=256 << 20,
        overlap_scheduling=overlap,
    )
    return LLM(str(model_dir), **{**options, **MODES[mode]})


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 15, 16, 17, 33, 100, 200)
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "synchronous"])
def test_greedy_on_gpu_equals_hf_in_float32(model_dir, hf_cuda, backend, mode, overlap):
    llm = make_llm(model_dir, backend, mode, overlap)
    outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts(), outs, strict=True):
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
    runner = llm.engine.worker.runner
    assert (runner.graphs is None) == (mode == "eager")
    if runner.graphs is not None:
        assert runner.graphs.launches > 0
    assert (runner.prefill_graphs is not None) == (mode in ("all-graphs", "small-buckets"))
    if runner.prefill_graphs is not None:
        assert runner.prefill_graphs.launches > 0
    assert llm.engine.worker.allocator.stats().num_used == 0


def mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=0.9,
            top_p=0.9,
            top_k=40 if i % 3 == 0 else 0,
            seed=7 + i,
            frequency_penalty=0.3,
            repetition_penalty=1.1,
            max_tokens=20,
            logprobs=1 if i == 1 else None,
        )
        if i % 2
        else SamplingParams(temperature=0, max_tokens=20)
        for i in range(len(prompts()))
    ]


@pytest.mark.parametrize("mode", ["eager", "all-graphs"])
def test_seeded_sampling_on_gpu_is_the_same_overlapped_and_synchronous(model_dir, mode):
    runs = []
    for overlap in (True, False):
        outs = make_llm(model_dir, BACKENDS[-1], mode, overlap).generate(prompts(), mixed_params())
        runs.append([(o.token_ids, o.logprobs) for o in outs])
    assert runs[0] == runs[1]


def test_staging_ring_refuses_a_rewrite_under_a_running_step_on_gpu(model_dir):
    llm = make_llm(model_dir, BACKENDS[-1], "decode-graphs")
    graphs = llm.engine.worker.runner.graphs
    graphs.staging = StagingRing(1, graphs.max_batch, graphs.max_blocks, pinned=True)
    with pytest.raises(StagingHazard):
        llm.generate(prompts()[:3], SamplingParams(temperature=0, max_tokens=8))
