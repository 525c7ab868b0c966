"""Which node of a pool gets a request (pure Python: plain numbers in, a node id out).

One `RoutingPolicy` per pool, chosen by name (`--prefill-policy`, `--decode-policy`) from
`POLICIES`:
- `round_robin`: the healthy nodes in turn (ordered by id).
- `least_load`: the least loaded node. Decode: most free KV blocks, then fewest running
  requests. Prefill: fewest queued prompt tokens, then fewest running.
- `cache_aware` (prefill only): the node whose prefix tree (`PrefixIndex`, what the router
  sent it) shares the longest prefix with the prompt, unless the pool is out of balance or
  the match is too short; then the least loaded node, ties going to the smallest tree (so
  new prefixes spread over the pool). The pool is out of balance when the most loaded
  node's queued tokens exceed the least loaded node's by more than `balance_abs_tokens`
  and by a factor of more than `balance_rel` (SGLang's router has the same two thresholds).

Load figures come from heartbeats (every ~0.5 s), so a burst would see the same stale load
and land on one node. `LoadLedger` adds what the router itself sent that the nodes may not
report yet: prompt tokens sent to a prefill node until its first token comes back, and KV
blocks of prompts sent to a decode node until that node's next heartbeat.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.prefix_index import PrefixIndex, chained_block_hashes

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class Candidate:
    node_id: str
    free_blocks: int = 0
    running: int = 0
    queued_tokens: int = 0
    kv_blocks: int = 0  # the node's KV pool size (0: unknown)


@dataclass(frozen=True)
class PolicyConfig:
    block_tokens: int = 16  # cache_aware: tokens per prefix-tree edge (the nodes' block size)
    min_match_ratio: float = 0.25  # cache_aware: shorter matches go to the least loaded node
    balance_abs_tokens: int = 4096
    balance_rel: float = 1.5
    max_tree_blocks: int = 1 << 20  # cache_aware: per node, unless its KV pool is smaller

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.max_tree_blocks < 1 or self.balance_abs_tokens < 0:
            raise ValueError(
                f"block_tokens and max_tree_blocks must be >= 1 and balance_abs_tokens >= 0, "
                f"got {self.block_tokens}, {self.max_tree_blocks}, {self.balance_abs_tokens}"
            )
        if not 0.0 <= self.min_match_ratio <= 1.0 or self.balance_rel < 1.0:
            raise ValueError(
                f"min_match_ratio must be in [0, 1] and balance_rel >= 1, "
                f"got {self.min_match_ratio}, {self.balance_rel}"
            )


class RoutingPolicy:
    """Base class: subclasses implement `choose`; `sent` / `node_lost` are optional hooks."""

    def __init__(self, pool: str, config: PolicyConfig) -> None:
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        self.pool = pool
        self.config = config

    def choose(self, candidates: Sequence[Candidate], prompt: Sequence[int]) -> str | None:
        """The node for a request with this prompt; None only when `candidates` is empty."""
        raise NotImplementedError

    def sent(self, node_id: str, prompt: Sequence[int]) -> None:
        """The router dispatched `prompt` to `node_id`."""

    def node_lost(self, node_id: str) -> None:
        """The node died or restarted: whatever it held is gone."""

    def load_key(self, c: Candidate) -> tuple[int, int]:
        if self.pool == "decode":
            return (-c.free_blocks, c.running)
        return (c.queued_tokens, c.running)


class RoundRobin(RoutingPolicy):
    def __init__(self, pool: str, config: PolicyConfig) -> None:
        super().__init__(pool, config)
        self._turn = 0

    def choose(self, candidates: Sequence[Candidate], prompt: Sequence[int]) -> str | None:
        if not candidates:
            return None
        ordered = sorted(c.node_id for c in candidates)
        self._turn += 1
        return ordered[(self._turn - 1) % len(ordered)]


class LeastLoad(RoutingPolicy):
    def choose(self, candidates: Sequence[Candidate], prompt: Sequence[int]) -> str | None:
        if not candidates:
            return None
        return min(candidates, key=lambda c: (*self.load_key(c), c.node_id)).node_id


class CacheAware(RoutingPolicy):
    def __init__(self, pool: str, config: PolicyConfig) -> None:
        if pool != "prefill":
            raise ValueError("cache_aware routes prefill requests only (decode nodes get KV)")
        super().__init__(pool, config)
        self.index = PrefixIndex(config.max_tree_blocks)

    def choose(self, candidates: Sequence[Candidate], prompt: Sequence[int]) -> str | None:
        if not candidates:
            return None
        for c in candidates:
            if c.kv_blocks > 0:
                self.index.set_capacity(c.node_id, min(c.kv_blocks, self.config.max_tree_blocks))
        fallback = min(
            candidates,
            key=lambda c: (*self.load_key(c), self.index.size(c.node_id), c.node_id),
        )
        if self._out_of_balance(candidates):
            return fallback.node_id
        hashes = chained_block_hashes(prompt, self.config.block_tokens)
        matched = self.index.match(hashes, [c.node_id for c in candidates])
        best = min(candidates, key=lambda c: (-matched[c.node_id], *self.load_key(c), c.node_id))
        blocks = matched[best.node_id]
        ratio = blocks * self.config.block_tokens / max(1, len(prompt))
        if blocks == 0 or ratio < self.config.min_match_ratio:
            return fallback.node_id
        return best.node_id

    def sent(self, node_id: str, prompt: Sequence[int]) -> None:
        self.index.insert(node_id, chained_block_hashes(prompt, self.config.block_tokens))

    def node_lost(self, node_id: str) -> None:
        self.index.remove_node(node_id)

    def _out_of_balance(self, candidates: Sequence[Candidate]) -> bool:
        loads = [c.queued_tokens for c in candidates]
        low, high = min(loads), max(loads)
        return high - low > self.config.balance_abs_tokens and high > self.config.balance_rel * low


POLICIES: dict[str, type[RoutingPolicy]] = {
    "round_robin": RoundRobin,
    "least_load": LeastLoad,
    "cache_aware": CacheAware,
}


def create_policy(name: str, pool: str, config: PolicyConfig) -> RoutingPolicy:
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy {name!r}; choose from {sorted(POLICIES)}")
    return cls(pool, config)


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
