"""How the nodes end a KV transfer that will not complete: the blocks always go back to both
pools, and the router hears of it once, from the node that knows.

Real `DecodeNode`s and `PrefillNode`s (tiny random Qwen2 on CPU) run in this process; the test
plays the router with real sockets (and, for the decode node alone, the prefill node with a real
`ZmqSender`). Messages from a node to the router travel one PUSH -> PULL pipe, so they arrive in
the order sent: a request rejected at once after the transfer ended proves what was (not) sent
before it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import zmq
from transformers import AutoModelForCausalLM, Qwen2Config

from common.config import CacheConfig, EngineConfig, ModelConfig
from common.messages import (
    DecodeRequest,
    FirstToken,
    PrefillRequest,
    RequestError,
    Reservation,
    decode,
)
from common.node_config import NodeConfig
from decode_node.node import DecodeNode
from kv_transfer import TransferConfig, create_sender
from prefill_node.node import PrefillNode
from tests.tiny_models import TINY_SHAPE

MAX_STEPS = 2000  # node steps; only a hang reaches it
FOREVER_S = 365 * 86400.0
RECEIVE_TIMEOUT_MS = 10_000  # only a hang reaches it
_ports = itertools.count(0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, max_position_embeddings=256, **TINY_SHAPE)
    folder = tmp_path_factory.mktemp("decode-node-qwen2")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return str(folder)


class Harness:
    """A decode node plus the sockets of the router and the prefill node it talks to."""

    def __init__(self, model_dir: str, tmp_path, deadline_s: float) -> None:
        n = next(_ports)
        self.context = zmq.Context.instance()
        router_address = f"ipc://{tmp_path}/router-{n}"
        self.prefill_address = f"ipc://{tmp_path}/prefill-{n}"
        self.router = self._pull(router_address)
        self.prefill = self._pull(self.prefill_address)
        engine = EngineConfig(
            model=ModelConfig(model=model_dir, device="cpu", dtype="float32"),
            cache=CacheConfig(num_kv_blocks=32),
            enforce_eager=True,
        )
        node_config = NodeConfig(
            control_address=f"ipc://{tmp_path}/decode-{n}",
            router_address=router_address,
            kv_address="tcp://127.0.0.1:0",
            transport="zmq",
            transfer_deadline_s=deadline_s,
        )
        self.node = DecodeNode(node_config, engine)
        self.blocks_at_start = self.node.worker.allocator.num_available

    def _pull(self, address: str) -> zmq.Socket:
        sock = self.context.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, RECEIVE_TIMEOUT_MS)
        sock.bind(address)
        return sock

    def reserve(self, request_id: str, prompt_len: int) -> Reservation:
        """The router's DecodeRequest; steps until the node sends the prefill its blocks."""
        prompt = list(range(10, 10 + prompt_len))
        self.node.handle(DecodeRequest(request_id, prompt, {"max_tokens": 4}, self.prefill_address))
        self.node.step()
        reservation = decode(self.prefill.recv())
        assert isinstance(reservation, Reservation) and reservation.request_id == request_id
        return reservation

    def step_until_ended(self, request_id: str) -> None:
        for _ in range(MAX_STEPS):
            if request_id not in self.node.timings:
                return
            self.node.step()
        raise AssertionError(f"{request_id} never ended")

    def next_router_message(self) -> object:
        """What the node sent the router first from now on, after a request it rejects at once
        (invalid sampling parameters) marks the end of what came before."""
        self.node.handle(DecodeRequest("marker", [1, 2], {"temperature": -1}, self.prefill_address))
        return decode(self.router.recv())

    def close(self) -> None:
        self.node.receiver.close()
        self.node.channel.close()
        self.node.worker.close()
        self.router.close(linger=0)
        self.prefill.close(linger=0)


@pytest.fixture
def harness(model_dir, tmp_path):
    made: list[Harness] = []

    def make(deadline_s: float = 30.0) -> Harness:
        made.append(Harness(model_dir, tmp_path, deadline_s))
        return made[-1]

    yield make
    for h in made:
        h.close()


def test_a_transfer_its_sender_aborts_frees_the_blocks_and_sends_the_router_nothing(harness):
    """The prefill node aborts the transfer when its first token finished the request (or the
    router aborted it, or it failed and said so). The router already has that answer from the
    prefill node; an error from the decode node could overtake it on the router's socket and
    turn a finished request into a 500."""
    h = harness()
    reservation = h.reserve("done-at-first-token", prompt_len=40)
    assert h.node.worker.allocator.num_available == h.blocks_at_start - len(reservation.block_ids)
    source_pool = torch.zeros(h.node.worker.kv_cache.pool.shape)
    sender = create_sender(TransferConfig(transport="zmq"), source_pool)
    try:
        blocks = list(range(len(reservation.block_ids)))
        sender.begin(
            reservation.request_id, h.node.receiver.address, blocks, reservation.block_ids.tolist()
        )
        sender.abort(reservation.request_id, "finished at the first token")
        sender.flush()  # hands the abort frame to zmq
        h.step_until_ended(reservation.request_id)
    finally:
        sender.close()
    assert h.node.worker.allocator.num_available == h.blocks_at_start
    first = h.next_router_message()
    assert isinstance(first, RequestError) and first.request_id == "marker", first
    assert h.node.stats["kv_transfers_ended_by_sender"] == 1
    assert h.node.stats["kv_transfer_failures"] == 0


def test_a_transfer_that_passes_its_deadline_frees_the_blocks_and_fails_the_request(harness):
    """No sender ever came (the prefill node died): only the decode node knows, so it tells."""
    h = harness(deadline_s=0.2)
    reservation = h.reserve("never-sent", prompt_len=40)
    h.step_until_ended(reservation.request_id)
    assert h.node.worker.allocator.num_available == h.blocks_at_start
    assert h.node.stats["kv_transfer_failures"] == 1
    error = h.next_router_message()
    assert isinstance(error, RequestError) and error.request_id == "never-sent"
    assert error.status == 500 and error.message == "KV transfer failed: deadline exceeded"


def engine_config(model_dir: str) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model_dir, device="cpu", dtype="float32"),
        cache=CacheConfig(num_kv_blocks=32),
        enforce_eager=True,
    )


@pytest.mark.parametrize("transport", ["cuda_ipc", "zmq"])
def test_a_first_token_that_finishes_the_request_frees_the_decode_reservation_at_once(
    model_dir, tmp_path, transport
):
    """max_tokens=1: the prefill node's first token ends the request before any KV moves. The
    decode node reserved blocks for it; over cuda_ipc its receiver holds a cancelled
    reservation until the would-be writer answers (here: the grace period is a year), so the
    prefill node declines the transfer. On CPU cuda_ipc takes its frames fallback, whose
    receiver holds such a reservation the same way."""
    context = zmq.Context.instance()
    router = context.socket(zmq.PULL)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, RECEIVE_TIMEOUT_MS)
    router_address = f"ipc://{tmp_path}/router"
    router.bind(router_address)
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
        decode_node.receiver._grace_s = FOREVER_S  # only the prefill node's word frees it
    try:
        free_at_start = decode_node.worker.allocator.num_available
        prompt = list(range(10, 50))
        sampling = {"max_tokens": 1, "temperature": 0}
        decode_node.handle(DecodeRequest("one", prompt, sampling, prefill_config.control_address))
        prefill_node.handle(
            PrefillRequest("one", prompt, sampling, decode_config.control_address,
                           decode_node.receiver.address)
        )  # fmt: skip
        for _ in range(MAX_STEPS):
            decode_node.step()
            prefill_node.step()
            decode_ended = not decode_node.timings and not decode_node.quarantined
            if decode_ended and not prefill_node.jobs:
                break
        else:
            raise AssertionError(
                f"still held: decode {list(decode_node.timings)} quarantined "
                f"{list(decode_node.quarantined)}, prefill {list(prefill_node.jobs)}"
            )
        assert decode_node.worker.allocator.num_available == free_at_start
        assert prefill_node.worker.allocator.stats().num_used == 0
        first = decode(router.recv())
        assert isinstance(first, FirstToken) and first.finished and first.request_id == "one"
        decode_node.handle(DecodeRequest("marker", [1, 2], {"temperature": -1}, None))
        error = decode(router.recv())
        assert isinstance(error, RequestError) and error.request_id == "marker", error
    finally:
        for node in (decode_node, prefill_node):
            node.channel.close()
            node.worker.close()
        decode_node.receiver.close()
        prefill_node.sender.close()
        router.close(linger=0)
