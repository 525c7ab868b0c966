"""The decode node's reservation queue (pure Python): FIFO, all-or-nothing, growth headroom."""

from __future__ import annotations

from common.engine.block_allocator import BlockAllocator
from common.protocol.messages import DecodeRequest
from common.protocol.sampling_params import SamplingParams
from decode_node.reservations import ReservationQueue


def request(rid: str, tokens: int) -> DecodeRequest:
    return DecodeRequest(rid, list(range(tokens)), SamplingParams(), "tcp://prefill")


def test_reservations_are_fifo_and_take_the_prompts_blocks():
    queue = ReservationQueue(BlockAllocator(10, block_size=4))
    queue.add(request("a", 9))  # 3 blocks
    queue.add(request("b", 4))  # 1 block
    first = queue.reserve_next()
    assert first.request.request_id == "a" and len(first.block_ids) == 3
    assert queue.reserve_next().request.request_id == "b"
    assert queue.num_reserved_blocks == 4


def test_a_reservation_waits_rather_than_eat_into_the_growth_headroom():
    allocator = BlockAllocator(10, block_size=4)
    queue = ReservationQueue(allocator)
    queue.add(request("a", 16))  # 4 blocks: 6 would stay, 3 must
    queue.add(request("b", 16))  # 4 more: 2 would stay
    assert queue.reserve_next(keep_free=3).request.request_id == "a"
    assert queue.reserve_next(keep_free=3) is None
    assert list(queue.waiting) == ["b"] and allocator.num_available == 6
    assert queue.reserve_next(keep_free=0).request.request_id == "b"  # an empty node takes it


def test_release_frees_reserved_blocks_and_forgets_waiting_requests():
    allocator = BlockAllocator(10, block_size=4)
    queue = ReservationQueue(allocator)
    queue.add(request("a", 8))
    queue.add(request("b", 8))
    queue.reserve_next()
    assert queue.release("a") and queue.release("b") and not queue.release("c")
    assert allocator.num_available == 10 and not queue.waiting and not queue.reserved
