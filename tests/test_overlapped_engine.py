"""The overlapped engine loop on CPU: same tokens as the synchronous loop and as HF transformers,
with the decode-graph path (its static buffers, padding, staging ring and shared logits run on
CPU without capture) and without it. A tiny random Qwen2 in float32."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from common import LLM, SamplingParams
from common.engine.config import EngineConfig, add_dataclass_args, engine_config_from_args
from common.engine.cuda_graphs import StagingHazard, StagingRing
from tests.hf_oracle import hf_greedy
from tests.tiny_models import TINY_SHAPE

VOCAB = 384
LENGTHS = (1, 15, 16, 17, 33, 100)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        **TINY_SHAPE,
        max_position_embeddings=512,
        initializer_range=0.25,
        tie_word_embeddings=False,
    )
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp("overlap-qwen2")
    hf.save_pretrained(folder)
    return str(folder), hf


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def engine(folder: str, overlap: bool, graphs: bool, **options) -> LLM:
    llm = LLM(
        folder,
        device="cpu",
        overlap_scheduling=overlap,
        max_num_seqs=8,
        kv_cache_memory_bytes=32 << 20,
        **options,
    )
    if graphs:  # on CPU: the graph code path, replayed eagerly
        llm.engine.worker.runner.capture_graphs(8, llm.engine.runtime.max_model_len)
    return llm


def mixed_params() -> list[SamplingParams]:
    """Half greedy, half temperature + top-p/top-k + penalties + seeds; logprobs on some."""
    out = []
    for i, _ in enumerate(LENGTHS):
        if i % 2:
            out.append(
                SamplingParams(
                    temperature=0.9,
                    top_p=0.85,
                    top_k=60 if i == 3 else 0,
                    min_p=0.02,
                    seed=100 + i,
                    frequency_penalty=0.4,
                    presence_penalty=0.2,
                    repetition_penalty=1.15,
                    max_tokens=14,
                    logprobs=2 if i == 1 else None,
                )
            )
        else:
            out.append(SamplingParams(temperature=0, max_tokens=10 + i, ignore_eos=True))
    return out


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "synchronous"])
def test_greedy_equals_hf_overlapped_and_synchronous(model, overlap, graphs):
    folder, hf = model
    llm = engine(folder, overlap, graphs)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for prompt, out in zip(prompts(), llm.generate(prompts(), params), strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, 12)
    assert llm.engine.worker.allocator.stats().num_used == 0


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
def test_seeded_mixed_sampling_gives_the_same_tokens_overlapped_and_synchronous(model, graphs):
    folder, _ = model
    runs = {}
    for overlap in (True, False):
        outs = engine(folder, overlap, graphs).generate(prompts(), mixed_params())
        runs[overlap] = [(o.token_ids, o.finish_reason, o.logprobs) for o in outs]
    assert runs[True] == runs[False]
    sampled = [runs[True][i][0] for i in range(1, len(LENGTHS), 2)]
    assert all(len(set(tokens)) > 2 for tokens in sampled)  # they really sample


def test_overlapped_run_under_a_tiny_pool_preempts_and_matches_the_synchronous_one(model):
    folder, _ = model
    roomy = engine(folder, False, False)
    expected = [o.token_ids for o in roomy.generate(prompts(), mixed_params())]
    tight = engine(folder, True, True, num_kv_blocks=14, block_size=16)
    got = tight.generate(prompts(), mixed_params())
    assert [o.token_ids for o in got] == expected
    assert tight.engine.worker.allocator.stats().num_used == 0


def test_rewriting_a_staging_buffer_before_its_step_completed_is_refused(model):
    """With one staging slot the overlapped loop would stage step N+1 over the buffers step N
    may still be copying from: the ring refuses (on CPU as on GPU, by generation counts)."""
    folder, _ = model
    llm = engine(folder, True, True)
    graphs = llm.engine.worker.runner.graphs
    graphs.staging = StagingRing(1, graphs.max_batch, graphs.max_blocks, pinned=False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with pytest.raises(StagingHazard, match="rewritten while generation"):
        llm.generate(prompts()[:2], params)
    # The synchronous loop resolves each step before staging the next: one slot is enough.
    sync = engine(folder, False, True)
    sync_graphs = sync.engine.worker.runner.graphs
    sync_graphs.staging = StagingRing(1, sync_graphs.max_batch, sync_graphs.max_blocks, False)
    assert len(sync.generate(prompts()[0], params)[0].token_ids) == 6


def test_the_staging_ring_releases_slots_by_generation():
    ring = StagingRing(2, 4, 2, pinned=False)
    first, g1 = ring.acquire()
    second, g2 = ring.acquire()
    with pytest.raises(StagingHazard):
        ring.acquire()  # slot 0 again, its step not observed complete
    first.release(g1)
    assert ring.acquire()[0] is first
    second.release(g2)


def test_overlap_scheduling_flag_is_derived_from_the_config():
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, EngineConfig)
    assert engine_config_from_args(parser.parse_args([])).overlap_scheduling is True
    off = parser.parse_args(["--no-overlap-scheduling"])
    assert engine_config_from_args(off).overlap_scheduling is False
