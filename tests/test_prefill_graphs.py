"""Prefill and mixed steps through the piecewise-graph path (`common/engine/prefill_graphs.py`) on CPU,
where nothing is captured but the data flow is the GPU's: padding to a token bucket, static
buffers between pieces, eager attention at each boundary. Greedy output equals HF transformers.
The capture itself is covered by tests/test_gpu_engine.py on a GPU."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from common import LLM, SamplingParams
from common.engine.prefill_graphs import _joined_rows, _split_heads, token_buckets
from common.engine.scheduler import ScheduledBatch, ScheduledSeq
from common.engine.sequence import Sequence
from tests.hf_oracle import hf_greedy

VOCAB = 320


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.25,
        tie_word_embeddings=False,
    )
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp("prefill-graphs-llama")
    hf.save_pretrained(folder)
    return str(folder), hf


def engine(folder: str, overlap: bool, max_tokens: int = 64) -> LLM:
    llm = LLM(
        folder,
        device="cpu",
        overlap_scheduling=overlap,
        max_num_batched_tokens=48,  # long prompts run as chunks, mixed with decodes
        kv_cache_memory_bytes=32 << 20,
    )
    llm.engine.worker.runner.capture_prefill_graphs(max_tokens)
    return llm


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 16, 40, 90, 130)]


def test_token_buckets_grow_by_powers_then_by_256():
    assert token_buckets(64) == [16, 32, 64]
    assert token_buckets(1024) == [16, 32, 64, 128, 256, 512, 768, 1024]
    assert token_buckets(1280) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280]
    with pytest.raises(ValueError, match="multiple of 16"):
        token_buckets(100)


def test_q_k_v_split_from_one_projection_are_copied_as_its_rows():
    qkv = torch.randn(5, (4 + 2 * 2) * 8)
    q, k, v = _split_heads(qkv, 4, 2, 8)
    assert q.shape == (5, 4, 8) and v.shape == (5, 2, 8) and torch.equal(v[1, 1], qkv[1, 56:])
    rows = _joined_rows(q, k, v)
    assert rows is not None and rows.data_ptr() == qkv.data_ptr() and torch.equal(rows, qkv)
    assert _joined_rows(q[:3], k[:3], v[:3]).shape == (3, 64)
    assert _joined_rows(q.clone(), k, v) is None  # a rotary that returned new tensors
    assert _joined_rows(q, v, k) is None  # another order


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "synchronous"])
def test_graph_path_prefill_and_mixed_steps_give_hf_greedy_output(model, overlap):
    folder, hf = model
    llm = engine(folder, overlap)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts(), params)
    for prompt, out in zip(prompts(), outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, 10)
    assert llm.engine.worker.runner.prefill_graphs.launches > 0


def test_steps_above_the_largest_bucket_run_eagerly(model):
    folder, hf = model
    llm = LLM(folder, device="cpu", kv_cache_memory_bytes=32 << 20)  # 2048-token steps
    llm.engine.worker.runner.capture_prefill_graphs(32)
    prompt = prompts()[4]  # 130 tokens in one step
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 1)
    assert llm.engine.worker.runner.prefill_graphs.launches == 0


def test_the_per_layer_hook_runs_after_each_layer_on_the_graph_path(model):
    """The prefill node ships a layer's KV from this hook: it must see every layer, in order,
    with that layer's KV already in the cache."""
    folder, _ = model
    llm = engine(folder, overlap=False)
    worker = llm.engine.worker
    prompt = prompts()[2]
    seq = Sequence("hooked", prompt, SamplingParams(temperature=0, max_tokens=1))
    seq.block_ids = worker.allocator.allocate(3)
    slots = torch.tensor([seq.block_ids[p // 16] * 16 + p % 16 for p in range(len(prompt))])
    seen = []

    def hook(layer: int) -> None:
        k_cache = worker.kv_cache.k_caches[layer]
        written = k_cache.flatten(0, 1)[slots].abs().sum().item()
        seen.append((layer, written > 0))

    worker.runner.execute(ScheduledBatch([ScheduledSeq(seq, 0, len(prompt))]), hook)
    assert seen == [(layer, True) for layer in range(3)]
    assert worker.runner.prefill_graphs.launches == 1


def test_the_qkv_projection_writes_into_the_static_buffer(model, monkeypatch):
    """Each layer's qkv projection lands in the pieces' `qkv` buffer
    (`_Boundary.projection_buffer`), where the eager attention reads it: on CUDA, where the
    rotation is in place, no boundary copy follows (on CPU the rotated copies are copied
    back)."""
    from common.model.layers.linear import QKVParallelLinear

    folder, hf = model
    llm = engine(folder, overlap=False)
    buffer = llm.engine.worker.runner.prefill_graphs.qkv
    into_buffer = []
    project = QKVParallelLinear.forward

    def spy(self, x, out=None):
        y = project(self, x, out)
        into_buffer.append(y.data_ptr() == buffer.data_ptr())
        return y

    monkeypatch.setattr(QKVParallelLinear, "forward", spy)
    prompt = prompts()[2]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 2)
    # the prefill step's three layers through the buffer; the decode step's eager layers not
    assert into_buffer == [True] * 3 + [False] * 3


def test_the_output_projection_runs_with_the_attention_into_the_static_buffer(model):
    """The o_proj of each layer runs eagerly after the attention (`attention_projected`),
    writing the buffer the next piece reads: the attention's output is not copied."""
    folder, hf = model
    llm = engine(folder, overlap=False)
    graphs = llm.engine.worker.runner.prefill_graphs
    graphs.attn_out.fill_(float("nan"))  # read by no piece: the output stays NaN-free
    prompt = prompts()[3]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.token_ids == hf_greedy(hf, prompt, 2)
    layers = llm.engine.worker.model.model.layers
    assert graphs.projects == [layer.self_attn.project for layer in layers]
    assert graphs.attn_out.isnan().all()
