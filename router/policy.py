"""Which prefill and decode node get a request (pure Python: plain numbers in, a node id out).

Heartbeats arrive every ~0.5 s, so a burst of requests would all see the same stale load and
land on one node. `LoadLedger` adds what the router itself sent and the nodes may not report
yet: prompt tokens sent to a prefill node until its first token comes back, and KV blocks of
prompts sent to a decode node until that node's next heartbeat.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    node_id: str
    free_blocks: int = 0
    running: int = 0
    queued_tokens: int = 0


def pick_decode(candidates: Sequence[Candidate]) -> str | None:
    """Most free KV blocks, then fewest running requests, then the lowest id (deterministic)."""
    if not candidates:
        return None
    return min(candidates, key=lambda c: (-c.free_blocks, c.running, c.node_id)).node_id


def pick_prefill(candidates: Sequence[Candidate]) -> str | None:
    """Fewest queued prompt tokens, then the lowest id."""
    if not candidates:
        return None
    return min(candidates, key=lambda c: (c.queued_tokens, c.node_id)).node_id


class LoadLedger:
    """Per-node load the router caused and heartbeats do not show yet."""

    def __init__(self) -> None:
        self._prefill: dict[str, tuple[str, int]] = {}  # request id -> (node, prompt tokens)
        self._decode: dict[str, tuple[str, int]] = {}  # request id -> (node, KV blocks)
        self._prefill_tokens: dict[str, int] = {}
        self._decode_blocks: dict[str, int] = {}
        self._decode_count: dict[str, int] = {}

    def sent(
        self, request_id: str, prefill: str | None, tokens: int, decode: str, blocks: int
    ) -> None:
        if prefill is not None:
            self._prefill[request_id] = (prefill, tokens)
            self._prefill_tokens[prefill] = self._prefill_tokens.get(prefill, 0) + tokens
        self._decode[request_id] = (decode, blocks)
        self._decode_blocks[decode] = self._decode_blocks.get(decode, 0) + blocks
        self._decode_count[decode] = self._decode_count.get(decode, 0) + 1

    def prefill_done(self, request_id: str) -> None:
        """The prefill node produced the first token: the prompt is no longer queued there."""
        entry = self._prefill.pop(request_id, None)
        if entry is not None:
            self._prefill_tokens[entry[0]] -= entry[1]

    def decode_reported(self, node_id: str) -> None:
        """A heartbeat from a decode node: its own load now counts what was sent before it."""
        for request_id in [r for r, (node, _) in self._decode.items() if node == node_id]:
            del self._decode[request_id]
        self._decode_blocks[node_id] = 0
        self._decode_count[node_id] = 0

    def release(self, request_id: str) -> None:
        self.prefill_done(request_id)
        entry = self._decode.pop(request_id, None)
        if entry is not None:
            self._decode_blocks[entry[0]] -= entry[1]
            self._decode_count[entry[0]] -= 1

    def prefill_tokens(self, node_id: str) -> int:
        return self._prefill_tokens.get(node_id, 0)

    def decode_pending(self, node_id: str) -> tuple[int, int]:
        """(KV blocks, requests) sent to the node since its last heartbeat."""
        return self._decode_blocks.get(node_id, 0), self._decode_count.get(node_id, 0)
