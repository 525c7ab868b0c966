"""FIFO of requests waiting for KV blocks, and the blocks reserved for in-flight transfers.

Pure Python. Ownership: blocks returned by `reserve_next` belong to the reservation until the
caller either admits the request (blocks move to its Sequence) or calls `release`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from common.engine.block_allocator import BlockAllocator
from common.protocol.messages import DecodeRequest


@dataclass
class PendingDecode:
    request: DecodeRequest
    arrived_at: float = field(default_factory=time.monotonic)
    reserved_at: float | None = None
    block_ids: list[int] = field(default_factory=list)


class ReservationQueue:
    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.waiting: OrderedDict[str, PendingDecode] = OrderedDict()
        self.reserved: dict[str, PendingDecode] = {}

    def add(self, request: DecodeRequest) -> None:
        self.waiting[request.request_id] = PendingDecode(request)

    def reserve_next(self, keep_free: int = 0) -> PendingDecode | None:
        """Reserve blocks for the oldest waiting request if the pool can hold its prompt and
        still have `keep_free` blocks available (growth room for running sequences)."""
        if not self.waiting:
            return None
        request_id, pending = next(iter(self.waiting.items()))
        needed = -(-len(pending.request.prompt_token_ids) // self.allocator.block_size)
        if self.allocator.num_available - needed < keep_free:
            return None
        blocks = self.allocator.allocate(needed)
        if blocks is None:
            return None
        del self.waiting[request_id]
        pending.block_ids = blocks
        pending.reserved_at = time.monotonic()
        self.reserved[request_id] = pending
        return pending

    def take(self, request_id: str) -> PendingDecode | None:
        """Hand a reserved request (and its blocks) to the caller."""
        return self.reserved.pop(request_id, None)

    def release(self, request_id: str) -> bool:
        """Drop a request wherever it is, freeing reserved blocks. True if it was known."""
        if self.waiting.pop(request_id, None) is not None:
            return True
        pending = self.reserved.pop(request_id, None)
        if pending is None:
            return False
        self.allocator.free(pending.block_ids)
        pending.block_ids = []
        return True

    @property
    def num_reserved_blocks(self) -> int:
        return sum(len(p.block_ids) for p in self.reserved.values())
