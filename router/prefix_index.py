"""What the router sent to each prefill node, as a prefix tree over chained block hashes.

Pure Python. A prompt is cut into blocks of `block_tokens` tokens; block i's hash chains the
hashes of blocks 0..i, so one hash names one path from the root of a prefix tree (a radix
tree whose edges are whole blocks), and the tree can be stored flat: hash -> nodes whose tree
holds that path. A node's tree approximates its prefix cache: the router cannot see the
node's evictions, so each node's tree is bounded by an LRU of `capacity` blocks.

Eviction never leaves a hole: inserting a path touches its blocks from the leaf to the root,
so an ancestor is always at least as recently used as any of its descendants and the LRU
drops leaves first. A match therefore walks the prompt's hashes until a node's tree ends.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


def chained_block_hashes(token_ids: Sequence[int], block_tokens: int) -> list[int]:
    """Hashes of the full blocks of `token_ids`, each chained onto the one before.

    Python's tuple hash: fast and stable within one router process, which is all it needs
    (the nodes' own prefix caches hash with blake2b; only the boundaries must agree)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        parent = hash((parent, tuple(token_ids[start : start + block_tokens])))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    def __init__(self, default_capacity: int) -> None:
        if default_capacity < 1:
            raise ValueError(f"default_capacity must be >= 1 block, got {default_capacity}")
        self.default_capacity = default_capacity
        self._owners: dict[int, set[str]] = {}  # block hash -> nodes whose tree holds it
        self._lru: dict[str, OrderedDict[int, None]] = {}  # per node, least recent first
        self._capacity: dict[str, int] = {}

    def set_capacity(self, node_id: str, blocks: int) -> None:
        """Bound one node's tree (e.g. by its KV pool size); evicts at once if it shrank."""
        if blocks < 1:
            raise ValueError(f"capacity of {node_id!r} must be >= 1 block, got {blocks}")
        self._capacity[node_id] = blocks
        self._evict(node_id)

    def match(self, hashes: Sequence[int], node_ids: Iterable[str]) -> dict[str, int]:
        """Matched leading blocks per node in `node_ids` (0 when nothing matches)."""
        matched = dict.fromkeys(node_ids, 0)
        for depth, block_hash in enumerate(hashes):
            owners = self._owners.get(block_hash)
            if not owners:
                break
            extended = False
            for node_id in owners:
                if matched.get(node_id) == depth:
                    matched[node_id] = depth + 1
                    extended = True
            if not extended:
                break
        return matched

    def insert(self, node_id: str, hashes: Sequence[int]) -> None:
        """Record that `node_id` was sent this path (it will cache it); evicts past capacity."""
        lru = self._lru.setdefault(node_id, OrderedDict())
        for block_hash in reversed(hashes):  # leaf first: the root ends most recent
            if block_hash in lru:
                lru.move_to_end(block_hash)
            else:
                lru[block_hash] = None
                self._owners.setdefault(block_hash, set()).add(node_id)
        self._evict(node_id)

    def remove_node(self, node_id: str) -> None:
        """The node lost its cache (died or restarted): forget its whole tree."""
        for block_hash in self._lru.pop(node_id, {}):
            self._drop_owner(block_hash, node_id)
        self._capacity.pop(node_id, None)

    def size(self, node_id: str) -> int:
        """Blocks in the node's tree."""
        return len(self._lru.get(node_id, ()))

    def _evict(self, node_id: str) -> None:
        lru = self._lru.get(node_id)
        if lru is None:
            return
        limit = self._capacity.get(node_id, self.default_capacity)
        while len(lru) > limit:
            block_hash, _ = lru.popitem(last=False)
            self._drop_owner(block_hash, node_id)

    def _drop_owner(self, block_hash: int, node_id: str) -> None:
        owners = self._owners.get(block_hash)
        if owners is not None:
            owners.discard(node_id)
            if not owners:
                del self._owners[block_hash]
