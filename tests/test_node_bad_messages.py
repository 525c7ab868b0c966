"""Messages no correct peer sends fail the one request they concern: its error goes to the
router, its blocks go back to the pool, and the node's loop goes on.

A real `PrefillNode` (tiny random Qwen2 on CPU, zmq transport) runs in this process; the test
plays the router (a PULL socket for the node's events), the decode node (a PULL socket for its
control messages) and the decode node's KV receiver (a real `ZmqReceiver` on a pool shaped like
the node's).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import zmq
from transformers import AutoModelForCausalLM, Qwen2Config

from common.config import CacheConfig, EngineConfig, ModelConfig
from common.messages import Abort, FirstToken, PrefillRequest, RequestError, Reservation, decode
from common.node_config import NodeConfig
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
