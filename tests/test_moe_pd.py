"""Qwen3-MoE and Mixtral through a prefill node and a decode node over zmq (CPU, fp32): the
nodes run in this process and the test plays the router with a real socket
(tests/node_harness.py's `NodePair`). Greedy tokens equal HF transformers' and the colocated
node's, and each transfer moves the K and V bytes of the prompt's blocks.

The models are tests/test_moe_parallel.py's tiny random ones, saved by transformers with the
published per-expert tensor names (Qwen3-MoE: 8 experts, top-2, a dense layer among three;
Mixtral: 4 experts, top-2, `block_sparse_moe.experts.N.w1/w2/w3`).
"""

from __future__ import annotations

import pytest
import torch

from tests.hf_oracle import hf_greedy
from tests.node_harness import BLOCK_SIZE, NodePair, colocated_tokens
from tests.test_moe_parallel import greedy, mixtral, qwen3_moe, save

VOCAB = 384
NEW_TOKENS = 6
MODELS = {"qwen3_moe": lambda: qwen3_moe(VOCAB), "mixtral": mixtral}


def random_prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


# 40 tokens: two full blocks and a partial one; 5 tokens: one partial block.
PROMPTS = [random_prompt(40, seed=1), random_prompt(5, seed=2)]


@pytest.fixture(scope="module", params=sorted(MODELS))
def moe(request, tmp_path_factory):
    """(folder, config, HF's greedy continuations of PROMPTS) of a saved tiny MoE model."""
    folder = tmp_path_factory.mktemp(request.param)
    config = MODELS[request.param]()
    hf = save(config, folder)
    return str(folder), config, [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


def kv_bytes(config, prompt_tokens: int) -> int:
    """What one transfer moves: whole blocks (a partial block's unused slots too) of K and V,
    every layer, fp32."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    slots = -(-prompt_tokens // BLOCK_SIZE) * BLOCK_SIZE
    per_slot = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return per_slot * torch.float32.itemsize * slots


def test_pd_over_zmq_gives_hf_and_colocated_tokens_and_moves_the_kv_bytes(moe, tmp_path):
    folder, config, expected = moe
    assert colocated_tokens(folder, tmp_path, greedy(NEW_TOKENS), PROMPTS) == expected
    pd = NodePair(folder, tmp_path, greedy(NEW_TOKENS))
    try:
        assert pd.decode.worker.model.model.layers[0].mlp.experts.num_experts == (
            config.num_local_experts if hasattr(config, "num_local_experts") else config.num_experts
        )
        for i, (prompt, want) in enumerate(zip(PROMPTS, expected, strict=True)):
            before = pd.decode.stats["kv_transfer_bytes"]  # the receiver's Transfer.nbytes
            assert pd.generate(f"r{i}", prompt) == want, len(prompt)
            assert pd.decode.stats["kv_transfer_bytes"] - before == kv_bytes(config, len(prompt))
        assert pd.decode.stats["kv_transfer_failures"] == 0
    finally:
        pd.close()
