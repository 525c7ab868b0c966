"""Messages no correct peer sends fail the one request they concern: its error goes to the
router, its blocks go back to the pool, and the node's loop goes on.

Real `PrefillNode`s and `DecodeNode`s run in this process, their peers played by the test
(`tests/node_harness.py`).
"""

from __future__ import annotations

import dataclasses

import pytest

from common.protocol.messages import Abort, FirstToken, RequestError, decode
from kv_transfer import TransferState
from tests.node_harness import FOREVER_S, DecodeHarness, PrefillHarness, save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("bad-messages-qwen2"))


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
    (`_before_launch`), and the request fails before its first token; one copy: after the
    first token went out (`_first_token_ready`, the cuda_ipc short path: the token is not
    held back for the transfer's setup), so the error follows it."""
    prefill.node._stream_min_tokens = 0 if streamed else 10**9
    prefill.node.sender.begin("refused", prefill.receiver.address, [31], [0])
    prefill.receiver.expect("fine", [0])
    prefill.node.handle(prefill.request("refused", num_blocks=1))
    prefill.node.handle(prefill.reservation("refused", [1]))
    prefill.node.handle(prefill.request("fine", num_blocks=1))
    prefill.node.handle(prefill.reservation("fine", [0]))
    prefill.step_until_idle()
    sent: dict[str, list] = {}
    for _ in range(2 if streamed else 3):
        message = decode(prefill.router.recv())
        sent.setdefault(message.request_id, []).append(message)
    *first, error = sent["refused"]
    assert [type(m) for m in first] == ([] if streamed else [FirstToken])
    assert isinstance(error, RequestError) and error.status == 500, error
    assert error.message == "KV transfer failed: transfer 'refused' is already active"
    assert [type(m) for m in sent["fine"]] == [FirstToken]
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


@pytest.fixture
def decode_node(model_dir, tmp_path):
    made: list[DecodeHarness] = []

    def make(transport: str = "zmq") -> DecodeHarness:
        made.append(DecodeHarness(model_dir, tmp_path, transport))
        return made[-1]

    yield make
    for h in made:
        h.close()


@pytest.mark.parametrize("transport", ["zmq", "cuda_ipc"])
def test_a_decode_request_naming_no_reachable_prefill_node_gets_a_503(decode_node, transport):
    """The router's types allow any string: connecting to "bogus" raised ZMQError out of
    `_reserve_blocks`, with the blocks reserved and the receiver expecting them. The blocks
    come back at once, cuda_ipc too: no sender was ever told of them, so none can write them
    (a cancel would hold them for its grace period, here a year)."""
    h = decode_node(transport)
    if transport == "cuda_ipc":
        h.node.admission.receiver._grace_s = FOREVER_S
    h.node.handle(h.request("lost", prefill_node="bogus"))
    h.node.step()
    error = decode(h.router.recv())
    assert isinstance(error, RequestError) and error.request_id == "lost", error
    assert error.status == 503 and error.message == "cannot reach prefill node 'bogus'"
    assert h.blocks_used() == 0 and not h.node.requests and not h.node.admission.num_reserved
    h.reserves("lost")  # the receiver forgot the id: it may come again


def test_a_request_id_whose_transfer_is_still_quarantined_is_refused_as_a_duplicate(decode_node):
    """cuda_ipc: an aborted reservation stays quarantined until its would-be writer answers
    (here never). The same id again used to pass `_accept`, and the receiver's "already
    active" ValueError at the next reservation ended the process."""
    h = decode_node("cuda_ipc")
    h.node.admission.receiver._grace_s = FOREVER_S
    h.reserves("again")
    h.node.handle(Abort("again"))
    assert h.quarantined() == ["again"]
    h.node.handle(h.request("again"))
    h.node.step()
    error = decode(h.router.recv())
    assert isinstance(error, RequestError) and error.request_id == "again", error
    assert error.status == 400 and error.message == "duplicate request id 'again'"
    assert h.quarantined() == ["again"] and list(h.node.requests) == ["again"]
    h.reserves("other")
