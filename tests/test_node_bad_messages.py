"""Messages no correct peer sends fail the one request they concern: its error goes to the
router, its blocks go back to the pool, and the node's loop goes on.

Real `PrefillNode`s and `DecodeNode`s (tiny random Qwen2 on CPU) run in this process. The test
plays their peers with real sockets: the router (a PULL socket for the node's events), the
other node (a PULL socket for its control messages) and, for a prefill node, the decode node's
KV receiver (a real `ZmqReceiver` on a pool shaped like the node's).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import zmq
from transformers import AutoModelForCausalLM, Qwen2Config

from common.config import CacheConfig, EngineConfig, ModelConfig
from common.messages import (
    Abort,
    DecodeRequest,
    FirstToken,
    PrefillRequest,
    RequestError,
    Reservation,
    decode,
)
from common.node_config import NodeConfig
from decode_node.node import DecodeNode
from kv_transfer import Transfer, TransferConfig, TransferState, create_receiver
from prefill_node.node import PrefillNode
from tests.tiny_models import TINY_SHAPE

MAX_STEPS = 2000  # node steps; only a hang reaches it
RECEIVE_TIMEOUT_MS = 10_000  # only a hang reaches it
BLOCK_SIZE = 16  # CacheConfig's default
_ports = itertools.count(0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, max_position_embeddings=256, **TINY_SHAPE)
    folder = tmp_path_factory.mktemp("bad-messages-qwen2")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return str(folder)


def engine_config(model_dir: str) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model_dir, device="cpu", dtype="float32"),
        cache=CacheConfig(num_kv_blocks=32),
        enforce_eager=True,
    )


def pull(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, RECEIVE_TIMEOUT_MS)
    sock.bind(address)
    return sock


class PrefillHarness:
    """A prefill node plus the sockets of the router and the decode node it talks to."""

    def __init__(self, model_dir: str, tmp_path) -> None:
        n = next(_ports)
        router_address = f"ipc://{tmp_path}/router-{n}"
        self.decode_address = f"ipc://{tmp_path}/decode-{n}"
        self.router = pull(router_address)
        self.decode = pull(self.decode_address)
        config = NodeConfig(
            control_address=f"ipc://{tmp_path}/prefill-{n}",
            router_address=router_address,
            transport="zmq",
        )
        self.node = PrefillNode(config, engine_config(model_dir))
        pool = torch.zeros(self.node.worker.kv_cache.pool.shape)
        self.receiver = create_receiver(TransferConfig(transport="zmq"), pool, "tcp://127.0.0.1:0")

    def request(self, request_id: str, num_blocks: int) -> PrefillRequest:
        """The router's request for a prompt of `num_blocks` blocks (the last one partial)."""
        prompt = list(range(10, 10 + (num_blocks - 1) * BLOCK_SIZE + 5))
        sampling = {"max_tokens": 4, "temperature": 0}
        return PrefillRequest(
            request_id, prompt, sampling, self.decode_address, self.receiver.address
        )

    def reservation(self, request_id: str, block_ids: list[int]) -> Reservation:
        return Reservation(request_id, self.decode_address, block_ids)

    def step_until_idle(self) -> None:
        for _ in range(MAX_STEPS):
            if not self.node.jobs:
                return
            self.node.step()
        raise AssertionError(f"still held: {list(self.node.jobs)}")

    def transfers(self, count: int) -> dict[str, Transfer]:
        """The next `count` transfers the KV receiver saw end, by request id."""
        ended: dict[str, Transfer] = {}
        for _ in range(MAX_STEPS):
            if len(ended) == count:
                return ended
            ended.update((t.request_id, t) for t in self.receiver.poll(timeout_s=0.01))
        raise AssertionError(f"only {list(ended)} of {count} transfers ended")

    def serves(self, request_id: str) -> None:
        """A well-formed request goes through: first token out, its KV in the reserved block."""
        self.receiver.expect(request_id, [7, 8])
        self.node.handle(self.request(request_id, num_blocks=2))
        self.node.handle(self.reservation(request_id, [7, 8]))
        self.step_until_idle()
        first = decode(self.router.recv())
        assert isinstance(first, FirstToken) and first.request_id == request_id, first
        assert self.transfers(1)[request_id].state is TransferState.DONE

    def blocks_used(self) -> int:
        return self.node.worker.allocator.stats().num_used

    def close(self) -> None:
        self.node.sender.close()
        self.node.channel.close()
        self.node.worker.close()
        self.receiver.close()
        self.router.close(linger=0)
        self.decode.close(linger=0)


@pytest.fixture
def prefill(model_dir, tmp_path):
    h = PrefillHarness(model_dir, tmp_path)
    yield h
    h.close()


@pytest.mark.parametrize(
    ("num_blocks", "block_ids"), [(1, [-1]), (2, [5, 5])], ids=["negative", "repeated"]
)
def test_a_reservation_of_bad_block_ids_fails_that_request_with_a_400(
    prefill, num_blocks, block_ids
):
    """The count was right, so the job started; the sender refused the ids at the prompt's
    last chunk, and its ValueError ended the prefill node's process."""
    prefill.node.handle(prefill.request("bad", num_blocks))
    prefill.node.handle(prefill.reservation("bad", block_ids))
    prefill.step_until_idle()
    error = decode(prefill.router.recv())
    assert isinstance(error, RequestError) and error.request_id == "bad", error
    assert error.status == 400 and "negative or repeated block ids" in error.message
    assert decode(prefill.decode.recv()) == Abort("bad")  # the decode node frees its blocks
    assert prefill.blocks_used() == 0
    prefill.serves("next")


def test_a_repeated_reservation_or_request_is_ignored_and_the_first_one_stands(prefill):
    """A second, longer Reservation used to replace the first after the job had started: the
    transfer then had one source block and two destinations, and the sender's ValueError
    ended the process."""
    prefill.receiver.expect("twice", [3])
    prefill.node.handle(prefill.request("twice", num_blocks=1))
    prefill.node.handle(prefill.reservation("twice", [3]))
    prefill.node.handle(prefill.reservation("twice", [3, 4]))
    prefill.node.handle(prefill.request("twice", num_blocks=2))
    assert prefill.node.stats["repeated_reservations"] == 1
    assert prefill.node.stats["repeated_requests"] == 1
    prefill.step_until_idle()
    first = decode(prefill.router.recv())
    assert isinstance(first, FirstToken) and first.request_id == "twice", first
    transfer = prefill.transfers(1)["twice"]
    assert transfer.state is TransferState.DONE and transfer.block_ids == [3]
    assert prefill.blocks_used() == 0


@pytest.mark.parametrize("streamed", [True, False], ids=["per-layer", "one-copy"])
def test_a_transfer_the_sender_refuses_fails_only_that_request_with_a_500(prefill, streamed):
    """The reservation checks make a refusal a bug; should one happen anyway (here: a transfer
    under the same id is still active in the sender), that request fails, not the step's
    other requests or the process. Per layer: the transfer begins before the step
    (`_before_launch`); one copy: after it (`_first_token_ready`, the cuda_ipc short path)."""
    prefill.node._stream_min_tokens = 0 if streamed else 10**9
    prefill.node.sender.begin("refused", prefill.receiver.address, [31], [0])
    prefill.receiver.expect("fine", [0])
    prefill.node.handle(prefill.request("refused", num_blocks=1))
    prefill.node.handle(prefill.reservation("refused", [1]))
    prefill.node.handle(prefill.request("fine", num_blocks=1))
    prefill.node.handle(prefill.reservation("fine", [0]))
    prefill.step_until_idle()
    sent = {m.request_id: m for m in (decode(prefill.router.recv()) for _ in range(2))}
    error = sent["refused"]
    assert isinstance(error, RequestError) and error.status == 500, error
    assert error.message == "KV transfer failed: transfer 'refused' is already active"
    assert isinstance(sent["fine"], FirstToken)
    assert decode(prefill.decode.recv()) == Abort("refused")
    assert prefill.transfers(1)["fine"].state is TransferState.DONE
    assert prefill.blocks_used() == 0
    prefill.node.sender.abort("refused", "the test is over")


def test_a_prefill_request_naming_no_reachable_decode_node_fails_without_the_process(prefill):
    """The request is refused (here: its reservation) and the Abort to its decode node has
    nowhere to go: connecting to "bogus" raised ZMQError out of the node's loop."""
    request = dataclasses.replace(prefill.request("lost", num_blocks=1), decode_node="bogus")
    prefill.node.handle(request)
    prefill.node.handle(prefill.reservation("lost", [-1]))
    prefill.step_until_idle()
    error = decode(prefill.router.recv())
    assert isinstance(error, RequestError) and error.request_id == "lost", error
    assert error.status == 400
    assert prefill.blocks_used() == 0
    prefill.serves("next")


FOREVER_S = 365 * 86400.0


class DecodeHarness:
    """A decode node plus the sockets of the router and the prefill node it talks to."""

    def __init__(self, model_dir: str, tmp_path, transport: str) -> None:
        n = next(_ports)
        router_address = f"ipc://{tmp_path}/router-d{n}"
        self.prefill_address = f"ipc://{tmp_path}/prefill-d{n}"
        self.router = pull(router_address)
        self.prefill = pull(self.prefill_address)
        config = NodeConfig(
            control_address=f"ipc://{tmp_path}/decode-d{n}",
            router_address=router_address,
            kv_address="tcp://127.0.0.1:0",
            transport=transport,
        )
        self.node = DecodeNode(config, engine_config(model_dir))

    def request(self, request_id: str, prefill_node: str | None = None) -> DecodeRequest:
        prompt, sampling = list(range(10, 50)), {"max_tokens": 4}
        return DecodeRequest(request_id, prompt, sampling, prefill_node or self.prefill_address)

    def reserves(self, request_id: str) -> None:
        """A well-formed request gets its blocks and the prefill node its Reservation."""
        self.node.handle(self.request(request_id))
        self.node.step()
        reservation = decode(self.prefill.recv())
        assert isinstance(reservation, Reservation) and reservation.request_id == request_id

    def blocks_used(self) -> int:
        return self.node.worker.allocator.stats().num_used

    def close(self) -> None:
        self.node.receiver.close()
        self.node.channel.close()
        self.node.worker.close()
        self.router.close(linger=0)
        self.prefill.close(linger=0)


@pytest.fixture
def decode_node(model_dir, tmp_path):
    made: list[DecodeHarness] = []

    def make(transport: str = "zmq") -> DecodeHarness:
        made.append(DecodeHarness(model_dir, tmp_path, transport))
        return made[-1]

    yield make
    for h in made:
        h.close()


def test_a_decode_request_naming_no_reachable_prefill_node_gets_a_400(decode_node):
    """The router's types allow any string: connecting to "bogus" raised ZMQError out of
    `_reserve_blocks`, with the blocks reserved and the receiver expecting them."""
    h = decode_node()
    h.node.handle(h.request("lost", prefill_node="bogus"))
    h.node.step()
    error = decode(h.router.recv())
    assert isinstance(error, RequestError) and error.request_id == "lost", error
    assert error.status == 400 and error.message == "cannot reach prefill node 'bogus'"
    assert h.blocks_used() == 0 and not h.node.timings and not h.node.reservations.reserved
    h.reserves("lost")  # the receiver forgot the id: it may come again


def test_a_request_id_whose_transfer_is_still_quarantined_is_refused_as_a_duplicate(decode_node):
    """cuda_ipc: an aborted reservation stays quarantined until its would-be writer answers
    (here never). The same id again used to pass `_accept`, and the receiver's "already
    active" ValueError at the next reservation ended the process."""
    h = decode_node("cuda_ipc")
    h.node.receiver._grace_s = FOREVER_S
    h.reserves("again")
    h.node.handle(Abort("again"))
    assert list(h.node.quarantined) == ["again"]
    h.node.handle(h.request("again"))
    h.node.step()
    error = decode(h.router.recv())
    assert isinstance(error, RequestError) and error.request_id == "again", error
    assert error.status == 400 and error.message == "duplicate request id 'again'"
    assert list(h.node.quarantined) == ["again"] and not h.node.timings
    h.reserves("other")
