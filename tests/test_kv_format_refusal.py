"""Pools that store KV differently never exchange it: the router pairs a decode node only with
prefill nodes of its `KVFormat` (else a 503 naming both), and a decode node refuses KV of
another format even when sent straight to it, ending the request with an error naming both
sides and keeping no block on either node.

Router: the real FastAPI app with loopback nodes. Transport: real `PrefillNode`s and
`DecodeNode`s (tiny random Qwen2 on CPU, tests/node_harness.py) in this process, the test
playing the router with a real socket.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.kv_format import KVFormat
from common.node.config import NodeConfig
from common.protocol.messages import (
    DecodeRequest,
    PrefillRequest,
    RequestError,
    TokenBatch,
)
from common.protocol.sampling_params import SamplingParams
from decode_node.node import DecodeNode
from kv_transfer import TransferConfig, TransferState, create_sender
from prefill_node.node import PrefillNode
from router.app import create_app
from router.config import RouterConfig
from router.registry import NodeRegistry
from tests.fp8_kv import needs_fp8_attention
from tests.node_harness import (
    MAX_STEPS,
    DecodeHarness,
    drain,
    engine_config,
    pull,
    save_tiny_model,
)
from tests.router_fakes import LoopbackNodes, ManualClock, generation_script, heartbeat
from tests.test_router_api_errors import assert_openai_error, call

P, P2, D = "tcp://127.0.0.1:5601", "tcp://127.0.0.1:5602", "tcp://127.0.0.1:5701"
F32 = KVFormat(
    kv_dtype="float32",
    kv_scales="none",
    quantization="none",
    architecture="Qwen2ForCausalLM",
    num_layers=30,
    planes=2,
    num_kv_heads=3,
    head_dim=64,
    block_size=16,
)
FP8 = dataclasses.replace(F32, kv_dtype="float8_e4m3fn", kv_scales="all 1.0")
PROMPT = list(range(10, 50))


# -- the router ---------------------------------------------------------------------------------


@pytest.fixture
def router(source, tokenizer):
    link = LoopbackNodes(generation_script([28120, 905]))
    config = RouterConfig(prefill=(P, P2), decode=(D,), served_model_name="smol")
    app = create_app(config, source=source, tokenizer=tokenizer, link=link, clock=ManualClock())
    link.deliver = app.state.core.on_message
    return app, link


def beat(app, node: str, role: str, kv_format: KVFormat) -> None:
    app.state.core.on_message(heartbeat(node, role, kv_format=kv_format.to_dict()))


def test_no_prefill_node_of_the_decode_nodes_kv_format_is_a_503_naming_both(router):
    app, link = router
    beat(app, P, "prefill", FP8)
    beat(app, D, "decode", F32)
    response = call(app, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 2})
    message = assert_openai_error(response, 503)
    assert f"prefill node {P} vs decode node {D}" in message
    assert "kv_dtype float8_e4m3fn (prefill) vs float32 (decode)" in message
    assert "kv_scales all 1.0 (prefill) vs none (decode)" in message
    assert link.sent == []  # nothing reached a node: nothing to free


def test_a_latent_cache_prefill_node_and_a_kv_decode_node_are_a_503_naming_both_geometries(
    router,
):
    app, link = router
    latent = dataclasses.replace(
        F32, architecture="DeepseekV2ForCausalLM", planes=1, num_kv_heads=1, head_dim=576
    )
    beat(app, P, "prefill", latent)
    beat(app, D, "decode", F32)
    message = assert_openai_error(call(app, "POST", "/v1/completions", {"prompt": "a"}), 503)
    assert "architecture DeepseekV2ForCausalLM (prefill) vs Qwen2ForCausalLM (decode)" in message
    assert "cache geometry latent 1 x 576 (prefill) vs K/V 3 heads x 64 (decode)" in message
    assert link.sent == []


def test_requests_go_only_to_the_prefill_node_of_the_decode_nodes_kv_format(router):
    app, link = router
    beat(app, P, "prefill", FP8)
    beat(app, P2, "prefill", F32)
    beat(app, D, "decode", F32)
    for _ in range(4):
        response = call(app, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 2})
        assert response.status_code == 200, response.text
    assert {node for node, _ in link.sent_of(PrefillRequest)} == {P2}


def test_the_registry_logs_a_mismatched_pair_once_and_refuses_a_malformed_format(caplog):
    registry = NodeRegistry([P], [D], timeout=3.0, colocated=False)
    with caplog.at_level(logging.ERROR, logger="router.registry"):
        for now in (1.0, 1.5, 2.0):
            registry.observe(heartbeat(P, "prefill", kv_format=FP8.to_dict()), now)
            registry.observe(heartbeat(D, "decode", kv_format=F32.to_dict()), now)
    logged = [r.getMessage() for r in caplog.records if "cannot exchange KV" in r.getMessage()]
    assert len(logged) == 1 and P in logged[0] and D in logged[0]
    assert "kv_dtype float8_e4m3fn (prefill) vs float32 (decode)" in logged[0]
    registry.observe(heartbeat(P2, "prefill", kv_format={"kv_dtype": 8}), 2.0)
    assert "malformed 'kv_format'" in registry.nodes[P2].problem


# -- the transport: KV sent straight to a decode node ------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("kv-format-refusal-qwen2"))


def assert_no_block_held(decode_node: DecodeNode, prefill_node: PrefillNode | None = None):
    """What the heartbeat load reports (the leak tests' counters): every KV block free."""
    load = decode_node.load()
    assert (load["used_blocks"], load["reserved"], load["quarantined"]) == (0, 0, 0), load
    if prefill_node is not None:
        load = prefill_node.load()
        assert (load["used_blocks"], load["transferring"]) == (0, 0), load


def test_fp8_kv_sent_straight_to_a_decode_node_of_another_format_is_refused(model_dir, tmp_path):
    """No router in between (an old one, or direct use): the prefill side here is a real
    sender over an FP8 pool announcing its format."""
    h = DecodeHarness(model_dir, tmp_path, "zmq")
    try:
        ours = h.node.worker.runtime.kv_format
        theirs = dataclasses.replace(ours, kv_dtype="float8_e4m3fn", kv_scales="all 1.0")
        pool = torch.zeros(h.node.worker.kv_cache.pool.shape, dtype=torch.float8_e4m3fn)
        reservation = h.reserves("r")
        reserved = reservation.block_ids.tolist()
        with create_sender(TransferConfig(kv_format=theirs), pool) as sender:
            sender.begin("r", h.node.admission.receiver.address, list(range(len(reserved))),
                         reserved)  # fmt: skip
            sender.send_layers("r", range(pool.shape[0]))
            sender.complete("r", {"first_token": 7})
            sender.flush()
            for _ in range(MAX_STEPS):
                if "r" not in h.node.requests:
                    break
                h.node.step()
            (sent,) = sender.poll()
        assert sent.state is TransferState.DONE  # zmq: its caller frees the source blocks
        errors: list[RequestError] = []
        for _ in range(MAX_STEPS):  # the error may still be on its way through the socket
            errors += [m for m in drain(h.router) if isinstance(m, RequestError)]
            if errors or not h.router.poll(10_000):
                break
        (error,) = errors
        assert error.request_id == "r" and error.status == 500
        assert "kv_dtype float8_e4m3fn (prefill node, sender) vs float32 (decode node, " in (
            error.message
        )
        assert_no_block_held(h.node)
        assert h.node.stats["kv_transfer_failures"] == 1
    finally:
        h.close()


def run_pair(
    tmp_path,
    name: str,
    prefill_engine: EngineConfig,
    decode_engine: EngineConfig,
    transport: str = "zmq",
    sampling: SamplingParams | None = None,
) -> tuple[list, DecodeNode, PrefillNode]:
    """One request from a prefill node built from `prefill_engine` to a decode node built from
    `decode_engine`, sent straight to them (no router to refuse the pair): what the router
    socket heard once both nodes hold nothing; the nodes (the caller closes them)."""
    router_address = f"ipc://{tmp_path}/router-{name}"
    router = pull(router_address)
    decode_config = NodeConfig(
        control_address=f"ipc://{tmp_path}/decode-{name}", router_address=router_address,
        kv_address="tcp://127.0.0.1:0", transport=transport,
    )  # fmt: skip
    prefill_config = NodeConfig(
        control_address=f"ipc://{tmp_path}/prefill-{name}", router_address=router_address,
        transport=transport,
    )  # fmt: skip
    decode_node = DecodeNode(decode_config, decode_engine)
    prefill_node = PrefillNode(prefill_config, prefill_engine)
    sampling = sampling or SamplingParams(max_tokens=4, temperature=0)
    decode_node.handle(DecodeRequest("r", PROMPT, sampling, prefill_config.control_address))
    prefill_node.handle(
        PrefillRequest("r", PROMPT, sampling, decode_config.control_address,
                       decode_node.admission.receiver.address)
    )  # fmt: skip
    heard = []
    for _ in range(MAX_STEPS):
        decode_node.step()
        prefill_node.step()
        heard += drain(router)
        if not decode_node.requests and not prefill_node.jobs:
            break

    def answered() -> bool:  # the request's error, or its finishing row
        return any(
            isinstance(m, RequestError) or (isinstance(m, TokenBatch) and any(m.finish_reasons))
            for m in heard
        )

    # The last message may still be in flight on the socket when both nodes are done.
    while not answered() and router.poll(10_000):
        heard += drain(router)
    router.close(linger=0)
    return heard, decode_node, prefill_node


def close(*nodes) -> None:
    for node in nodes:
        node.close()
        node.channel.close()


@pytest.mark.parametrize("transport", ["zmq", "cuda_ipc"])
def test_kv_of_a_differently_quantized_model_is_refused_and_no_node_keeps_a_block(
    model_dir, tmp_path, transport
):
    """Both pools float32, so every byte would fit: only the formats tell that the prefill
    node's K and V come from FP8 weights. (On CPU cuda_ipc takes its frames mode.)"""
    engine = engine_config(model_dir)
    quantized = dataclasses.replace(
        engine, model=dataclasses.replace(engine.model, quantization="fp8")
    )
    heard, decode_node, prefill_node = run_pair(
        tmp_path, transport, quantized, engine_config(model_dir), transport
    )
    try:
        errors = [m for m in heard if isinstance(m, RequestError) and m.request_id == "r"]
        assert errors and all(e.status == 500 for e in errors), heard
        assert (
            "quantization fp8 channel weights, token activations (prefill node, sender) vs none "
            "(decode node, receiver)" in errors[0].message
        )
        assert_no_block_held(decode_node, prefill_node)
    finally:
        close(decode_node, prefill_node)


@needs_fp8_attention
def test_a_real_fp8_prefill_node_is_refused_by_an_auto_decode_node(model_dir, tmp_path):
    engine = engine_config(model_dir)
    fp8 = dataclasses.replace(engine, cache=dataclasses.replace(engine.cache, kv_cache_dtype="fp8"))
    heard, decode_node, prefill_node = run_pair(tmp_path, "zmq", fp8, engine_config(model_dir))
    try:
        errors = [m for m in heard if isinstance(m, RequestError) and m.request_id == "r"]
        assert errors and errors[0].status == 500, heard
        assert "kv_dtype float8_e4m3fn (prefill node, sender) vs float32" in errors[0].message
        assert_no_block_held(decode_node, prefill_node)
    finally:
        close(decode_node, prefill_node)
