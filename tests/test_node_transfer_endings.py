"""How the nodes end a KV transfer that will not complete: the blocks always go back to both
pools, and the router hears of it once, from the node that knows.

Real `DecodeNode`s and `PrefillNode`s (tiny random Qwen2 on CPU) run in this process
(tests/node_harness.py); the test plays the router with real sockets and, for the decode node
alone, the prefill node with a real `ZmqSender`. Messages from a node to the router travel one
PUSH -> PULL pipe, so they arrive in the order sent: a request rejected at once after the
transfer ended proves what was (not) sent before it.
"""

from __future__ import annotations

import pytest
import torch

from common.node.config import NodeConfig
from common.protocol.messages import DecodeRequest, FirstToken, PrefillRequest, RequestError, decode
from common.protocol.sampling_params import SamplingParams
from decode_node.node import DecodeNode
from kv_transfer import TransferConfig, create_sender
from prefill_node.node import PrefillNode
from tests.node_harness import (
    FOREVER_S,
    MAX_STEPS,
    DecodeHarness,
    engine_config,
    pull,
    save_tiny_model,
)

OUT_OF_VOCAB = 10**6  # the tiny model's vocabulary has 256 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("transfer-endings-qwen2"))


@pytest.fixture
def harness(model_dir, tmp_path):
    made: list[DecodeHarness] = []

    def make(deadline_s: float = 30.0) -> DecodeHarness:
        made.append(DecodeHarness(model_dir, tmp_path, "zmq", transfer_deadline_s=deadline_s))
        return made[-1]

    yield make
    for h in made:
        h.close()


def step_until_ended(h: DecodeHarness, request_id: str) -> None:
    for _ in range(MAX_STEPS):
        if request_id not in h.node.requests:
            return
        h.node.step()
    raise AssertionError(f"{request_id} never ended")


def next_router_message(h: DecodeHarness) -> object:
    """What the node sent the router first from now on, after a request it rejects at once
    (a token outside the vocabulary) marks the end of what came before."""
    h.node.handle(DecodeRequest("marker", [OUT_OF_VOCAB], SamplingParams(), h.prefill_address))
    return decode(h.router.recv())


def test_a_transfer_its_sender_aborts_frees_the_blocks_and_sends_the_router_nothing(harness):
    """The prefill node aborts the transfer when its first token finished the request (or the
    router aborted it, or it failed and said so). The router already has that answer from the
    prefill node; an error from the decode node could overtake it on the router's socket and
    turn a finished request into a 500."""
    h = harness()
    free_at_start = h.node.worker.allocator.num_available
    reservation = h.reserves("done-at-first-token")
    reserved = reservation.block_ids.tolist()
    assert h.node.worker.allocator.num_available == free_at_start - len(reserved)
    sender = create_sender(
        TransferConfig(transport="zmq"), torch.zeros(h.node.worker.kv_cache.pool.shape)
    )
    try:
        blocks = list(range(len(reserved)))
        sender.begin(reservation.request_id, h.node.admission.receiver.address, blocks, reserved)
        sender.abort(reservation.request_id, "finished at the first token")
        sender.flush()  # hands the abort frame to zmq
        step_until_ended(h, reservation.request_id)
    finally:
        sender.close()
    assert h.node.worker.allocator.num_available == free_at_start
    first = next_router_message(h)
    assert isinstance(first, RequestError) and first.request_id == "marker", first
    assert h.node.stats["kv_transfers_ended_by_sender"] == 1
    assert h.node.stats["kv_transfer_failures"] == 0


def test_a_transfer_that_passes_its_deadline_frees_the_blocks_and_fails_the_request(harness):
    """No sender ever came (the prefill node died): only the decode node knows, so it tells."""
    h = harness(deadline_s=0.2)
    free_at_start = h.node.worker.allocator.num_available
    h.reserves("never-sent")
    step_until_ended(h, "never-sent")
    assert h.node.worker.allocator.num_available == free_at_start
    assert h.node.stats["kv_transfer_failures"] == 1
    error = next_router_message(h)
    assert isinstance(error, RequestError) and error.request_id == "never-sent"
    assert error.status == 500 and error.message == "KV transfer failed: deadline exceeded"


@pytest.mark.parametrize("transport", ["cuda_ipc", "zmq"])
def test_a_first_token_that_finishes_the_request_frees_the_decode_reservation_at_once(
    model_dir, tmp_path, transport
):
    """max_tokens=1: the prefill node's first token ends the request before any KV moves. The
    decode node reserved blocks for it; over cuda_ipc its receiver holds a cancelled
    reservation until the would-be writer answers (here: the grace period is a year), so the
    prefill node declines the transfer. On CPU cuda_ipc takes its frames fallback, whose
    receiver holds such a reservation the same way."""
    router_address = f"ipc://{tmp_path}/router"
    router = pull(router_address)
    decode_config = NodeConfig(
        control_address=f"ipc://{tmp_path}/decode", router_address=router_address,
        kv_address="tcp://127.0.0.1:0", transport=transport,
    )  # fmt: skip
    prefill_config = NodeConfig(
        control_address=f"ipc://{tmp_path}/prefill", router_address=router_address,
        transport=transport,
    )  # fmt: skip
    decode_node = DecodeNode(decode_config, engine_config(model_dir))
    prefill_node = PrefillNode(prefill_config, engine_config(model_dir))
    if transport == "cuda_ipc":
        decode_node.admission.receiver._grace_s = FOREVER_S  # only the prefill node's word frees it
    try:
        free_at_start = decode_node.worker.allocator.num_available
        prompt = list(range(10, 50))
        sampling = SamplingParams(max_tokens=1, temperature=0)
        decode_node.handle(DecodeRequest("one", prompt, sampling, prefill_config.control_address))
        prefill_node.handle(
            PrefillRequest("one", prompt, sampling, decode_config.control_address,
                           decode_node.admission.receiver.address)
        )  # fmt: skip
        for _ in range(MAX_STEPS):
            decode_node.step()
            prefill_node.step()
            if not decode_node.requests and not prefill_node.jobs:
                break
        else:
            raise AssertionError(
                f"still held: decode {list(decode_node.requests)}, "
                f"prefill {list(prefill_node.jobs)}"
            )
        assert decode_node.worker.allocator.num_available == free_at_start
        assert prefill_node.worker.allocator.stats().num_used == 0
        first = decode(router.recv())
        assert isinstance(first, FirstToken) and first.finished and first.request_id == "one"
        decode_node.handle(DecodeRequest("marker", [OUT_OF_VOCAB], SamplingParams(), None))
        error = decode(router.recv())
        assert isinstance(error, RequestError) and error.request_id == "marker", error
    finally:
        for node in (decode_node, prefill_node):
            node.close()
            node.channel.close()
        router.close(linger=0)
