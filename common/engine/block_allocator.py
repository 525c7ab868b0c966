"""Paged KV block allocator with reference counts and prefix caching (pure Python, no torch).

Every block is in exactly one state:
- used: refcount > 0. Each holder owns one reference (from `allocate`, `incref` or
  `match_prefix`) and gives it back with exactly one `free`.
- cached: refcount 0 but still holding a registered hash, so a later `match_prefix` can reuse
  its KV contents; kept in an LRU that `allocate` evicts from.
- free: refcount 0 and no hash; its contents are garbage.
Only refcount-0 blocks are ever evicted or handed out again.
"""

import hashlib
import struct
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash one block's tokens chained onto the hash of everything before it.

    Deterministic across processes and runs (blake2b, not Python's salted `hash`). The result
    is an unsigned 64-bit int. `parent_hash` must fit in a signed 128-bit int.
    """
    hasher = hashlib.blake2b(digest_size=8)
    if parent_hash is None:
        hasher.update(b"\x00")
    else:
        hasher.update(b"\x01" + parent_hash.to_bytes(16, "little", signed=True))
    hasher.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(hasher.digest(), "little")


def compute_block_hashes(
    token_ids: Sequence[int], block_size: int, extra_key: int | None = None
) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`; a trailing partial block is ignored.

    Hash i covers tokens [0, (i + 1) * block_size). `extra_key` (e.g. a LoRA or model id)
    seeds the first parent so equal tokens under different keys never share blocks.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[int] = []
    parent = extra_key
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class BlockStats:
    """Snapshot of block states; num_used + num_cached + num_free == num_total."""

    num_total: int
    num_used: int
    num_cached: int
    num_free: int


class BlockAllocator:
    """Tracks block ids only; the KV tensors live with the model runner.

    A hash is registered by the caller once all of a block's tokens are computed, and is
    dropped when the block is evicted or the prefix cache is reset.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refcounts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # Cached blocks, least recently freed first; values unused.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, int] = {}
        self._block_to_hash: dict[int, int] = {}
        # Prefix-cache lookups since start, as the callers record them (`record_prefix_lookup`):
        # what the stats line's hit rate is made of.
        self.prefix_queried_blocks = 0
        self.prefix_hit_blocks = 0

    @property
    def num_available(self) -> int:
        """Blocks `allocate()` could hand out now: free plus evictable cached."""
        return len(self._free) + len(self._evictable)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_available

    def allocate(self, n: int) -> list[int] | None:
        """Return `n` fresh blocks with refcount 1 owned by the caller, or None if short.

        On None nothing changed. Free blocks go first, then the least recently freed cached
        blocks, whose hashes are forgotten.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks: {n}")
        if n > self.num_available:
            return None
        block_ids: list[int] = []
        for _ in range(n):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                del self._hash_to_block[self._block_to_hash.pop(block_id)]
            assert self._refcounts[block_id] == 0 and block_id not in self._block_to_hash
            self._refcounts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Give back one reference per id; validates every id before changing anything.

        A block reaching refcount 0 becomes cached if it holds a hash, else free. Within one
        call the first block ends up most recently used, so a sequence freed head-to-tail has
        its tail evicted before its head.
        """
        block_ids = list(block_ids)
        for block_id, count in Counter(block_ids).items():
            self._check_range(block_id)
            if self._refcounts[block_id] < count:
                raise ValueError(
                    f"block {block_id} freed {count} time(s) but has refcount "
                    f"{self._refcounts[block_id]}"
                )
        for block_id in reversed(block_ids):
            self._refcounts[block_id] -= 1
            if self._refcounts[block_id] > 0:
                continue
            if block_id in self._block_to_hash:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    def incref(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block; each must already be referenced."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_range(block_id)
            if self._refcounts[block_id] == 0:
                raise ValueError(f"block {block_id} is not referenced; cannot share it")
        for block_id in block_ids:
            self._refcounts[block_id] += 1

    def match_prefix(self, block_hashes: Sequence[int]) -> list[int]:
        """Return blocks for the longest registered leading run of `block_hashes`.

        The caller owns one new reference on each returned block and frees it like any other.
        Counts nothing: the caller records the lookup once it uses the result
        (`record_prefix_lookup`).
        """
        if not self.enable_prefix_caching:
            return []
        block_ids: list[int] = []
        for block_hash in block_hashes:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            if self._refcounts[block_id] == 0:
                del self._evictable[block_id]
            self._refcounts[block_id] += 1
            block_ids.append(block_id)
        return block_ids

    def record_prefix_lookup(self, num_queried: int, num_hit: int) -> None:
        """Count one lookup of `num_queried` blocks that found `num_hit`. Record a prompt's
        lookup once, when it is admitted: a match given back because the rest of the prompt
        did not fit is looked up again at the next try, and that is no new lookup."""
        if not 0 <= num_hit <= num_queried:
            raise ValueError(f"a lookup of {num_queried} blocks cannot hit {num_hit}")
        self.prefix_queried_blocks += num_queried
        self.prefix_hit_blocks += num_hit

    def register_full_block(self, block_id: int, block_hash: int) -> None:
        """Make a referenced, fully computed block findable by `block_hash`.

        If another block already holds `block_hash` that mapping is kept and this block stays
        unhashed (it is freed rather than cached). No-op when prefix caching is off.
        """
        self._check_range(block_id)
        if self._refcounts[block_id] == 0:
            raise ValueError(f"block {block_id} is not referenced; cannot register it")
        if not self.enable_prefix_caching:
            return
        existing = self._block_to_hash.get(block_id)
        if existing is not None:
            if existing != block_hash:
                raise ValueError(
                    f"block {block_id} already has hash {existing}, cannot register {block_hash}"
                )
            return
        if block_hash in self._hash_to_block:
            return
        self._hash_to_block[block_hash] = block_id
        self._block_to_hash[block_id] = block_hash

    def refcount(self, block_id: int) -> int:
        self._check_range(block_id)
        return self._refcounts[block_id]

    def block_hash(self, block_id: int) -> int | None:
        self._check_range(block_id)
        return self._block_to_hash.get(block_id)

    def stats(self) -> BlockStats:
        num_cached = len(self._evictable)
        num_free = len(self._free)
        return BlockStats(
            num_total=self.num_blocks,
            num_used=self.num_blocks - num_cached - num_free,
            num_cached=num_cached,
            num_free=num_free,
        )

    def reset_prefix_cache(self) -> None:
        """Forget every hash; cached blocks become free, used blocks stay with their owners."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._hash_to_block.clear()
        self._block_to_hash.clear()

    def _check_range(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
