"""A node whose head waiting prompt cannot get its blocks waits on its sockets, not in a busy
loop: until something outside the scheduler frees blocks (a finished transfer, an ending, a
message), stepping again schedules nothing, and the engine says so (`EngineCore.stalled`).

Real nodes run in this process (`tests/node_harness.py`). The test holds the rest of a node's
pool straight from its allocator, standing in for the blocks of transfers in flight.
"""

from __future__ import annotations

import pytest

from common.protocol.messages import FirstToken, TokenBatch, decode
from kv_transfer import TransferState
from prefill_node.node import TRANSFER_WAIT_S
from tests.node_harness import MAX_STEPS, DecodeHarness, PrefillHarness, save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("loop-waits-qwen2"))


def test_a_prefill_node_whose_prompt_waits_for_blocks_waits_on_its_inbox(model_dir, tmp_path):
    h = PrefillHarness(model_dir, tmp_path)
    try:
        allocator = h.node.worker.allocator
        held = allocator.allocate(allocator.num_available - 1)
        h.receiver.expect("waits", [7, 8])
        h.node.handle(h.request("waits", num_blocks=2))
        h.node.handle(h.reservation("waits", [7, 8]))
        assert h.node.inbox_wait() == 0.0  # a step to try
        for _ in range(3):
            h.node.step()
            assert h.node.core.stalled and h.node.inbox_wait() == TRANSFER_WAIT_S
        allocator.free(held)
        h.node.step()
        assert not h.node.core.stalled
        h.step_until_idle()
        first = decode(h.router.recv())
        assert isinstance(first, FirstToken) and first.request_id == "waits", first
        assert h.transfers(1)["waits"].state is TransferState.DONE
        assert h.blocks_used() == 0
    finally:
        h.close()


def test_a_colocated_node_whose_prompt_waits_for_blocks_waits_on_its_inbox(model_dir, tmp_path):
    h = DecodeHarness(model_dir, tmp_path, "zmq", colocated=True)
    try:
        allocator = h.node.worker.allocator
        held = allocator.allocate(allocator.num_available - 1)
        h.node.handle(h.request("waits"))
        assert h.node.inbox_wait() == 0.0  # a step to try
        for _ in range(3):
            h.node.step()
            assert h.node.core.stalled and h.node.inbox_wait() > 0.0
        allocator.free(held)
        for _ in range(MAX_STEPS):
            if not h.node.requests:
                break
            h.node.step()
        first = decode(h.router.recv())
        assert isinstance(first, TokenBatch) and first.request_ids == ["waits"], first
        assert h.blocks_used() == 0
    finally:
        h.close()
