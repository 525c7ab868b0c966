"""DeepSeek (latent KV, experts with shared experts) through real nodes and ranks on CPU, fp32:

- PD over zmq: a prefill node and a decode node in this process (tests/node_harness.py's
  way), the test playing the router with a real socket; tiny DeepSeek-V2 and -V3 give HF's
  greedy tokens, as the colocated node does, and each transfer moves the latent's bytes;
- expert parallel 2 (gloo) for DeepSeek-V3 (shared expert, grouped routing, correction bias);
- PD from one prefill rank into a two-rank decode node (each rank caches the whole latent);
- a DeepSeek prefill node and a Qwen2 decode node: the real router refuses the pair.

The models are tests/test_deepseek_matches_hf.py's (`CONFIGS`, `build`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest
import torch
import zmq
from fastapi.testclient import TestClient

from common import LLM
from common.node.config import NodeConfig
from common.protocol.messages import (
    DecodeRequest,
    FirstToken,
    PrefillRequest,
    RequestError,
    TokenBatch,
    decode,
)
from common.protocol.sampling_params import SamplingParams
from decode_node.node import DecodeNode
from prefill_node.node import PrefillNode
from router.app import create_app
from router.config import RouterConfig
from tests.hf_oracle import hf_greedy
from tests.node_harness import BLOCK_SIZE, MAX_STEPS, engine_config, pull, save_tiny_model
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


def sampling() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def node_config(tmp_path, name: str, router: str, **fields) -> NodeConfig:
    return NodeConfig(control_address=f"ipc://{tmp_path}/{name}", router_address=router, **fields)


def drain(sock: zmq.Socket) -> Iterator[object]:
    while True:
        try:
            yield decode(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return


class Nodes:
    """A decode node (colocated, or paired with a prefill node over zmq) in this process; the
    test is the router: it sends the requests and reads the tokens from a real PULL socket."""

    def __init__(self, folder: str, tmp_path, colocated: bool = False, decode_tp: int = 1):
        mode = "colocated" if colocated else "pd"
        router = f"ipc://{tmp_path}/router-{mode}"
        self.router = pull(router)
        self.decode = DecodeNode(
            node_config(tmp_path, f"decode-{mode}", router, kv_address="tcp://127.0.0.1:0",
                        colocated=colocated),
            dataclasses.replace(engine_config(folder), tp=decode_tp),
        )  # fmt: skip
        self.prefill: PrefillNode | None = None
        if not colocated:
            prefill_config = node_config(tmp_path, f"prefill-{mode}", router)
            self.prefill = PrefillNode(prefill_config, engine_config(folder))

    def generate(self, request_id: str, prompt: list[int]) -> list[int]:
        """The request's tokens, the prefill node's first one included. The two nodes push to
        the router on separate pipes, so the first token may come after decode rows."""
        nodes = [self.decode] if self.prefill is None else [self.decode, self.prefill]
        prefill_id = None if self.prefill is None else self.prefill.channel.node_id
        self.decode.handle(DecodeRequest(request_id, prompt, sampling(), prefill_id))
        if self.prefill is not None:
            kv_address = self.decode.admission.receiver.address
            message = PrefillRequest(
                request_id, prompt, sampling(), self.decode.channel.node_id, kv_address
            )
            self.prefill.handle(message)
        first: list[int] = []
        rows: list[int] = []
        finished = False
        for _ in range(MAX_STEPS):
            for node in nodes:
                node.step()
            for message in drain(self.router):
                assert not isinstance(message, RequestError), message
                if isinstance(message, FirstToken):
                    first.append(message.token_id)
                elif isinstance(message, TokenBatch):
                    mine = [i for i, r in enumerate(message.request_ids) if r == request_id]
                    rows += [int(message.token_ids[i]) for i in mine]
                    finished |= any(message.finish_reasons[i] for i in mine)
            if finished and len(first) == len(nodes) - 1:
                return first + rows
        raise AssertionError(f"{request_id} did not finish: {first} + {rows}")

    def close(self) -> None:
        for node in (self.decode, self.prefill):
            if node is not None:
                node.close()
                node.channel.close()
        self.router.close(linger=0)


def latent_bytes(prompt_tokens: int) -> int:
    """What one transfer moves: the transport ships whole blocks (a partial block's unused
    slots too), one 576-value latent row per token slot and layer, fp32."""
    slots = -(-prompt_tokens // BLOCK_SIZE) * BLOCK_SIZE
    return LATENT * NUM_LAYERS * torch.float32.itemsize * slots


def test_pd_over_zmq_gives_hf_and_colocated_tokens_and_moves_the_latents_bytes(deepseek, tmp_path):
    folder, expected = deepseek
    colocated = Nodes(folder, tmp_path, colocated=True)
    try:
        assert [colocated.generate(f"c{i}", p) for i, p in enumerate(PROMPTS)] == expected
    finally:
        colocated.close()
    pd = Nodes(folder, tmp_path)
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
    pd = Nodes(folder, tmp_path, decode_tp=2)
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
