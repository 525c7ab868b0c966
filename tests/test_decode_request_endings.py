"""However a decode node's request ends, its record (`DecodeNode.requests`) is gone and every
block it held is back in the pool: the one ending path (`DecodeNode._end`) is taken each time.

A real `DecodeNode` (tiny random Qwen2 on CPU, tests/node_harness.py) runs in this process;
the test plays the router and, with a real `ZmqSender`, the prefill node.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from common.protocol.messages import Abort, RequestError, TokenBatch, decode
from decode_node.request import Phase
from kv_transfer import TransferConfig, create_sender
from tests.node_harness import MAX_STEPS, DecodeHarness, save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("request-endings-qwen2"))


@pytest.fixture
def harness(model_dir, tmp_path):
    made: list[DecodeHarness] = []

    def make(**kwargs) -> DecodeHarness:
        made.append(DecodeHarness(model_dir, tmp_path, "zmq", **kwargs))
        return made[-1]

    yield make
    for h in made:
        h.close()


@pytest.fixture
def sender(harness):
    made = []

    def make(h: DecodeHarness):
        kv_format = h.node.worker.runtime.kv_format  # the decode pool refuses any other
        config = TransferConfig(transport="zmq", kv_format=kv_format)
        made.append(create_sender(config, torch.zeros(h.node.worker.kv_cache.pool.shape)))
        return made[-1]

    yield make
    for s in made:
        s.close()


def step_until(h: DecodeHarness, done) -> None:
    for _ in range(MAX_STEPS):
        if done():
            return
        h.node.step()
    raise AssertionError(f"still held: {list(h.node.requests)}")


def assert_gone(h: DecodeHarness, request_id: str) -> None:
    assert request_id not in h.node.requests
    assert h.blocks_used() == 0
    assert h.node.load()["reserved"] == 0 and h.node.load()["quarantined"] == 0


def land(h: DecodeHarness, sender, request_id: str) -> None:
    """The prefill node's side: the reserved blocks' KV, then the completion notice."""
    reservation = h.reserves(request_id)
    reserved = reservation.block_ids.tolist()
    address = h.node.admission.receiver.address
    sender.begin(request_id, address, list(range(len(reserved))), reserved)
    sender.send_layers(request_id, range(h.node.worker.kv_cache.pool.shape[0]))
    sender.complete(request_id, {"first_token": 7})
    sender.flush()
    step_until(h, lambda: h.node.requests[request_id].phase is Phase.RUNNING)


def test_a_finished_request_leaves_nothing_behind(harness, sender):
    h = harness()
    land(h, sender(h), "done")
    step_until(h, lambda: "done" not in h.node.requests)
    assert_gone(h, "done")
    batches = [decode(h.router.recv()) for _ in range(3)]  # tokens 2..4 of max_tokens=4
    assert all(isinstance(b, TokenBatch) for b in batches)
    assert batches[-1].finish_reasons == ["length"]


def test_a_colocated_finished_request_leaves_nothing_behind(harness):
    h = harness(colocated=True)
    h.node.handle(h.request("done"))
    step_until(h, lambda: "done" not in h.node.requests)
    assert_gone(h, "done")


def test_an_abort_while_queued_or_reserved_frees_the_reservation(harness):
    h = harness()
    h.reserves("reserved")
    assert h.blocks_used() > 0
    h.node.handle(Abort("reserved"))
    assert_gone(h, "reserved")
    h.node.handle(h.request("queued"))  # not yet reserved: no step ran
    h.node.handle(Abort("queued"))
    assert_gone(h, "queued")
    assert h.node.load()["waiting"] == 0


def test_an_abort_while_running_frees_the_sequences_blocks(harness, sender):
    h = harness()
    land(h, sender(h), "running")
    assert h.blocks_used() > 0
    h.node.handle(Abort("running"))
    step_until(h, lambda: not h.node.core.has_work())
    assert_gone(h, "running")


def first_error(h: DecodeHarness) -> RequestError:
    event = decode(h.router.recv())
    while isinstance(event, TokenBatch):
        event = decode(h.router.recv())
    return event


def test_a_reserved_request_past_its_deadline_is_dropped_with_a_504(harness):
    h = harness()
    h.node.handle(dataclasses.replace(h.request("late"), deadline_s=0.05))
    step_until(h, lambda: "late" not in h.node.requests)  # the loop's expiry check
    assert_gone(h, "late")
    error = first_error(h)
    assert (error.request_id, error.status) == ("late", 504)
    assert h.node.stats["expired_requests"] == 1


def test_a_running_request_past_its_deadline_is_dropped_with_a_504(harness, sender):
    h = harness()
    land(h, sender(h), "late")
    h.node.requests["late"].deadline = time.monotonic()
    h.node.expire(time.monotonic() + 1.0)
    step_until(h, lambda: not h.node.core.has_work())
    assert_gone(h, "late")
    error = first_error(h)
    assert (error.request_id, error.status) == ("late", 504)


def test_a_failed_transfer_drops_the_request_and_its_reservation(harness):
    h = harness(transfer_deadline_s=0.2)
    h.reserves("failed")
    step_until(h, lambda: "failed" not in h.node.requests)
    assert_gone(h, "failed")
    error = decode(h.router.recv())
    assert isinstance(error, RequestError) and error.status == 500
