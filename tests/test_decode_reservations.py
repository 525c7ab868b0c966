"""The decode node's reservation queue (pure Python): FIFO, all-or-nothing, growth headroom."""

from __future__ import annotations

from common.engine.block_allocator import BlockAllocator
from common.engine.sequence import Sequence
from common.protocol.messages import DecodeRequest
from common.protocol.sampling_params import SamplingParams
from decode_node.request import DecodeTiming, Phase, Request
from decode_node.reservations import ReservationQueue


def request(rid: str, tokens: int) -> Request:
    prompt = list(range(tokens))
    message = DecodeRequest(rid, prompt, SamplingParams(), "tcp://prefill")
    return Request(message, Sequence(rid, prompt, SamplingParams()), DecodeTiming())


def test_reservations_are_fifo_and_take_the_prompts_blocks():
    allocator = BlockAllocator(10, block_size=4)
    queue = ReservationQueue(allocator)
    queue.add(request("a", 9))  # 3 blocks
    queue.add(request("b", 4))  # 1 block
    first = queue.reserve_next()
    assert first.id == "a" and len(first.block_ids) == 3
    assert first.phase is Phase.RESERVED and first.timing.reserved_at is not None
    assert queue.reserve_next().id == "b"
    assert allocator.num_available == 6


def test_a_reservation_waits_rather_than_eat_into_the_growth_headroom():
    allocator = BlockAllocator(10, block_size=4)
    queue = ReservationQueue(allocator)
    queue.add(request("a", 16))  # 4 blocks: 6 would stay, 3 must
    queue.add(request("b", 16))  # 4 more: 2 would stay
    assert queue.reserve_next(keep_free=3).id == "a"
    assert queue.reserve_next(keep_free=3) is None
    assert list(queue.waiting) == ["b"] and allocator.num_available == 6
    assert queue.reserve_next(keep_free=0).id == "b"  # an empty node takes it


def test_remove_forgets_a_waiting_request_and_leaves_the_pool_alone():
    allocator = BlockAllocator(10, block_size=4)
    queue = ReservationQueue(allocator)
    a, b = request("a", 8), request("b", 8)
    queue.add(a)
    queue.add(b)
    queue.remove(a)
    assert queue.reserve_next() is b and not queue.waiting
    queue.remove(b)  # reserved: its blocks are its record's now, freed when it ends
    assert allocator.num_available == 8
