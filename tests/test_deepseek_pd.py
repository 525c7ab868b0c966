"""DeepSeek (latent KV, experts with shared experts) through real nodes and ranks on CPU, fp32:

- PD over zmq: a prefill node and a decode node in this process (tests/node_harness.py's
  `NodePair`), the test playing the router with a real socket; tiny DeepSeek-V2 and -V3 give HF's
  greedy tokens, as the colocated node does, and each transfer moves the latent's bytes;
- expert parallel 2 (gloo) for DeepSeek-V3 (shared expert, grouped routing, correction bias);
- PD from one prefill rank into a two-rank decode node (each rank caches the whole latent);
- a DeepSeek prefill node and a Qwen2 decode node: the real router refuses the pair.

The models are tests/test_deepseek_matches_hf.py's (`CONFIGS`, `build`).
"""

from __future__ import annotations

import time

import pytest
import torch
from fastapi.testclient import TestClient

from common import LLM
from decode_node.node import DecodeNode
from prefill_node.node import PrefillNode
from router.app import create_app
from router.config import RouterConfig
from tests.hf_oracle import hf_greedy
from tests.node_harness import (
    BLOCK_SIZE,
    NodePair,
    colocated_tokens,
    engine_config,
    node_config,
    save_tiny_model,
)
from tests.test_deepseek_matches_hf import KV_BYTES, OPTIONS, build, greedy, random_prompt

NEW_TOKENS = 6
LATENT = 576  # kv_lora_rank 512 + rope 64 values per token and layer
NUM_LAYERS = 2  # the tiny models' (COMMON in test_deepseek_matches_hf)
# 40 tokens: two full blocks and a partial one; 5 tokens: one partial block.
PROMPTS = [random_prompt(40, seed=1), random_prompt(5, seed=2)]
MODELS = {"v2": "v2_greedy", "v3": "v3_lora_yarn"}


@pytest.fixture(scope="module", params=sorted(MODELS))
def deepseek(request, tmp_path_factory) -> tuple[str, list[list[int]]]:
    """A saved tiny DeepSeek and HF's greedy continuations of PROMPTS."""
    folder = tmp_path_factory.mktemp(MODELS[request.param])
    hf = build(MODELS[request.param], folder)
    return str(folder), [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def v2(tmp_path_factory) -> tuple[str, list[list[int]]]:
    folder = tmp_path_factory.mktemp("v2_alone")
    hf = build("v2_greedy", folder)
    return str(folder), [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


def latent_bytes(prompt_tokens: int) -> int:
    """What one transfer moves: the transport ships whole blocks (a partial block's unused
    slots too), one 576-value latent row per token slot and layer, fp32."""
    slots = -(-prompt_tokens // BLOCK_SIZE) * BLOCK_SIZE
    return LATENT * NUM_LAYERS * torch.float32.itemsize * slots


def test_pd_over_zmq_gives_hf_and_colocated_tokens_and_moves_the_latents_bytes(deepseek, tmp_path):
    folder, expected = deepseek
    assert colocated_tokens(folder, tmp_path, greedy(NEW_TOKENS), PROMPTS) == expected
    pd = NodePair(folder, tmp_path, greedy(NEW_TOKENS))
    try:
        for i, (prompt, want) in enumerate(zip(PROMPTS, expected, strict=True)):
            before = pd.decode.stats["kv_transfer_bytes"]  # the receiver's Transfer.nbytes
            assert pd.generate(f"r{i}", prompt) == want, len(prompt)
            moved = pd.decode.stats["kv_transfer_bytes"] - before
            assert moved == latent_bytes(len(prompt)), len(prompt)
        assert pd.decode.stats["kv_transfer_failures"] == 0
    finally:
        pd.close()


def test_pd_from_one_prefill_rank_into_two_decode_ranks_gives_hf_tokens(v2, tmp_path):
    """The decode ranks split the heads; each caches the whole latent, so the one frame per
    layer is written into both pools and the wire carries it once."""
    folder, expected = v2
    pd = NodePair(folder, tmp_path, greedy(NEW_TOKENS), decode_tp=2)
    try:
        worker = pd.decode.worker
        assert (worker.rank_spec.num_heads, worker.spec.num_heads) == (2, 4)
        assert worker.kv_cache.pool.shape[-2:] == (1, LATENT)
        for i, (prompt, want) in enumerate(zip(PROMPTS, expected, strict=True)):
            before = pd.decode.stats["kv_transfer_bytes"]
            assert pd.generate(f"r{i}", prompt) == want, len(prompt)
            assert pd.decode.stats["kv_transfer_bytes"] - before == latent_bytes(len(prompt))
    finally:
        pd.close()


def test_expert_parallel_2_holds_half_the_experts_with_the_shared_expert_and_equals_hf(
    tmp_path,
):
    """DeepSeek-V3's router (grouped top-k, correction bias) runs whole on each rank; rank r
    holds experts [4r, 4r + 4) whole and a slice of the shared expert: one all-reduce sums both."""
    hf = build("v3_lora_yarn", tmp_path)
    prompts = [random_prompt(n, seed=90 + n) for n in (3, 33)]
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    options = dict(OPTIONS, kv_cache_memory_bytes=KV_BYTES)
    with LLM(str(tmp_path), tp=2, enable_expert_parallel=True, **options) as llm:
        moe = llm.engine.worker.model.model.layers[1].mlp  # layer 0 is dense
        assert llm.engine.worker.runtime.expert_parallel
        assert moe.experts.expert_range == range(4) and moe.experts.gate_up_proj.shape[0] == 4
        assert moe.shared_experts is not None
        assert [o.token_ids for o in llm.generate(prompts, greedy(NEW_TOKENS))] == expected


def wait_until_healthy(client: TestClient) -> None:
    deadline = time.monotonic() + 60  # only a hang reaches it
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, client.get("/health").json()
        time.sleep(0.1)


def test_a_deepseek_prefill_node_and_a_qwen2_decode_node_are_refused_naming_both_geometries(
    v2, tmp_path, source, tokenizer
):
    """Real nodes heartbeat their own KV formats to the real router (its zmq events socket):
    it answers 503 naming both architectures and geometries and sends neither node anything.
    (tests/test_kv_format_refusal.py checks the same message from hand-written formats.)"""
    router = f"ipc://{tmp_path}/events"
    qwen2 = save_tiny_model(tmp_path / "qwen2")
    prefill = PrefillNode(node_config(tmp_path, "prefill", router), engine_config(v2[0]))
    decode_node = DecodeNode(
        node_config(tmp_path, "decode", router, kv_address="tcp://127.0.0.1:0"),
        engine_config(qwen2),
    )
    nodes = (prefill, decode_node)
    config = RouterConfig(
        prefill=(prefill.channel.node_id,), decode=(decode_node.channel.node_id,),
        events_address=router, served_model_name="m",
    )  # fmt: skip
    app = create_app(config, source=source, tokenizer=tokenizer)
    try:
        with TestClient(app) as client:
            for node in nodes:
                node.channel.start_heartbeat(node.info, node.loop.load())
            wait_until_healthy(client)
            body = {"model": "m", "prompt": [11, 12, 13], "max_tokens": 2}
            response = client.post("/v1/completions", json=body)
        assert response.status_code == 503, response.text
        message = response.json()["error"]["message"]
        theirs = decode_node.worker.runtime.kv_format
        assert "architecture DeepseekV2ForCausalLM (prefill) vs Qwen2ForCausalLM (decode)" in (
            message
        )
        assert (
            f"cache geometry latent 1 x {LATENT} (prefill) vs K/V {theirs.num_kv_heads} heads x "
            f"{theirs.head_dim} (decode)" in message
        )
        assert all(node.channel.receive(timeout_s=0.2) == [] for node in nodes)
    finally:
        for node in nodes:
            node.close()
            node.channel.close()
