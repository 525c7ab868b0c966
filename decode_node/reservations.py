"""FIFO of requests waiting for KV blocks (pure Python).

Ownership: blocks `reserve_next` allocates go to the request's `block_ids` and belong to it
until admission hands them to its sequence or the request ends (DecodeNode._end frees them).
"""

from __future__ import annotations

import time
from collections import OrderedDict

from common.engine.block_allocator import BlockAllocator
from decode_node.request import Phase, Request


class ReservationQueue:
    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.waiting: OrderedDict[str, Request] = OrderedDict()

    def add(self, request: Request) -> None:
        self.waiting[request.id] = request

    def reserve_next(self, keep_free: int = 0) -> Request | None:
        """Reserve blocks for the oldest waiting request if the pool can hold its prompt and
        still have `keep_free` blocks available (growth room for running sequences)."""
        if not self.waiting:
            return None
        request = next(iter(self.waiting.values()))
        needed = -(-request.num_prompt_tokens // self.allocator.block_size)
        if self.allocator.num_available - needed < keep_free:
            return None
        blocks = self.allocator.allocate(needed)
        if blocks is None:
            return None
        del self.waiting[request.id]
        request.block_ids = blocks
        request.timing.reserved_at = time.monotonic()
        request.phase = Phase.RESERVED
        return request

    def remove(self, request: Request) -> None:
        self.waiting.pop(request.id, None)
