import random
import subprocess
import sys
from pathlib import Path

import pytest

from common.engine.block_allocator import (
    BlockAllocator,
    BlockStats,
    compute_block_hashes,
    hash_block_tokens,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip()


def snapshot(allocator: BlockAllocator) -> tuple:
    refcounts = [allocator.refcount(b) for b in range(allocator.num_blocks)]
    hashes = [allocator.block_hash(b) for b in range(allocator.num_blocks)]
    return refcounts, hashes, allocator.stats(), allocator.num_available


def assert_invariants(allocator: BlockAllocator, held: dict[int, int]) -> None:
    """`held` maps block id -> references the test believes it owns."""
    stats = allocator.stats()
    assert stats.num_used + stats.num_cached + stats.num_free == stats.num_total
    refcounts = [allocator.refcount(b) for b in range(allocator.num_blocks)]
    assert refcounts == [held.get(b, 0) for b in range(allocator.num_blocks)]
    assert stats.num_used == sum(1 for r in refcounts if r > 0)
    cached = [
        b
        for b in range(allocator.num_blocks)
        if refcounts[b] == 0 and allocator.block_hash(b) is not None
    ]
    assert stats.num_cached == len(cached)
    assert allocator.num_available == stats.num_cached + stats.num_free


def fill_and_register(allocator: BlockAllocator, tokens: list[int]) -> list[int]:
    hashes = compute_block_hashes(tokens, allocator.block_size)
    blocks = allocator.allocate(len(hashes))
    assert blocks is not None
    for block_id, block_hash in zip(blocks, hashes, strict=True):
        allocator.register_full_block(block_id, block_hash)
    return blocks


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_refcounts_return_to_zero_after_every_sequence_finishes(seed, enable_prefix_caching):
    rng = random.Random(seed)
    allocator = BlockAllocator(16, block_size=4, enable_prefix_caching=enable_prefix_caching)
    sequences: list[list[int]] = []
    held: dict[int, int] = {}

    def take(blocks: list[int]) -> None:
        for b in blocks:
            held[b] = held.get(b, 0) + 1

    for _ in range(500):
        op = rng.random()
        if op < 0.35:
            blocks = allocator.allocate(rng.randint(0, 5))
            if blocks is not None:
                for b in blocks:
                    if rng.random() < 0.5:
                        allocator.register_full_block(b, rng.randrange(40))
                take(blocks)
                sequences.append(blocks)
        elif op < 0.5 and sequences:
            shared = rng.choice(sequences)[: rng.randint(0, 3)]
            allocator.incref(shared)
            take(shared)
            sequences.append(list(shared))
        elif op < 0.65:
            hashes = [rng.randrange(40) for _ in range(rng.randint(0, 4))]
            matched = allocator.match_prefix(hashes)
            assert [allocator.block_hash(b) for b in matched] == hashes[: len(matched)]
            take(matched)
            sequences.append(matched)
        elif sequences:
            blocks = sequences.pop(rng.randrange(len(sequences)))
            allocator.free(blocks)
            for b in blocks:
                held[b] -= 1
                if held[b] == 0:
                    del held[b]
        assert_invariants(allocator, held)

    for blocks in sequences:
        allocator.free(blocks)
    assert all(allocator.refcount(b) == 0 for b in range(allocator.num_blocks))
    stats = allocator.stats()
    assert stats.num_used == 0
    assert stats.num_cached + stats.num_free == stats.num_total == allocator.num_available


def test_double_free_raises_and_changes_nothing():
    allocator = BlockAllocator(4, block_size=2)
    a, b = allocator.allocate(2)
    allocator.free([a])
    before = snapshot(allocator)
    with pytest.raises(ValueError, match=str(a)):
        allocator.free([b, a])
    assert snapshot(allocator) == before
    assert allocator.refcount(b) == 1


def test_freeing_one_block_twice_in_one_call_raises_and_changes_nothing():
    allocator = BlockAllocator(4, block_size=2)
    (a,) = allocator.allocate(1)
    before = snapshot(allocator)
    with pytest.raises(ValueError, match=str(a)):
        allocator.free([a, a])
    assert snapshot(allocator) == before


@pytest.mark.parametrize("bad_id", [-1, 4, 100])
def test_out_of_range_block_id_raises_and_changes_nothing(bad_id):
    allocator = BlockAllocator(4, block_size=2)
    blocks = allocator.allocate(2)
    before = snapshot(allocator)
    with pytest.raises(ValueError, match=str(bad_id)):
        allocator.free([*blocks, bad_id])
    with pytest.raises(ValueError, match=str(bad_id)):
        allocator.incref([blocks[0], bad_id])
    with pytest.raises(ValueError, match=str(bad_id)):
        allocator.refcount(bad_id)
    assert snapshot(allocator) == before


def test_incref_of_unreferenced_block_raises_and_changes_nothing():
    allocator = BlockAllocator(4, block_size=2)
    a, b = allocator.allocate(2)
    allocator.free([b])
    before = snapshot(allocator)
    with pytest.raises(ValueError, match=str(b)):
        allocator.incref([a, b])
    assert snapshot(allocator) == before


def test_allocate_returns_none_without_side_effects_when_short():
    allocator = BlockAllocator(4, block_size=2)
    fill_and_register(allocator, list(range(4)))
    allocator.free(allocator.allocate(1))
    before = snapshot(allocator)
    assert not allocator.can_allocate(4)
    assert allocator.allocate(4) is None
    assert snapshot(allocator) == before
    assert allocator.allocate(0) == []


def test_constructor_rejects_empty_pool_and_zero_block_size():
    with pytest.raises(ValueError):
        BlockAllocator(0, block_size=4)
    with pytest.raises(ValueError):
        BlockAllocator(4, block_size=0)


def test_referenced_cached_block_is_never_handed_out_again():
    allocator = BlockAllocator(4, block_size=2)
    tokens = list(range(4))
    allocator.free(fill_and_register(allocator, tokens))
    assert allocator.stats().num_cached == 2

    shared = allocator.match_prefix(compute_block_hashes(tokens, 2))
    assert len(shared) == 2
    assert allocator.num_available == 2
    fresh = allocator.allocate(2)
    assert set(fresh).isdisjoint(shared)
    assert allocator.allocate(1) is None
    assert all(allocator.block_hash(b) is not None for b in shared)


def test_free_blocks_are_used_before_any_cached_block_is_evicted():
    allocator = BlockAllocator(4, block_size=2)
    cached = fill_and_register(allocator, list(range(4)))
    allocator.free(cached)
    fresh = allocator.allocate(2)
    assert set(fresh).isdisjoint(cached)
    assert allocator.stats().num_cached == 2


def test_least_recently_freed_block_is_evicted_first():
    allocator = BlockAllocator(2, block_size=1)
    first, second = fill_and_register(allocator, [7, 8])
    allocator.free([second])
    allocator.free([first])

    (evicted,) = allocator.allocate(1)
    assert evicted == second
    assert allocator.block_hash(second) is None
    assert allocator.block_hash(first) is not None


def test_tail_of_a_prefix_is_evicted_before_its_head():
    allocator = BlockAllocator(3, block_size=1)
    tokens = [10, 11, 12]
    head, middle, tail = fill_and_register(allocator, tokens)
    allocator.free([head, middle, tail])

    assert allocator.allocate(1) == [tail]
    assert allocator.allocate(1) == [middle]
    assert allocator.allocate(1) == [head]


def test_matched_block_leaves_the_lru_and_returns_as_most_recent():
    allocator = BlockAllocator(2, block_size=1)
    a, b = fill_and_register(allocator, [1, 2])
    allocator.free([a, b])
    matched = allocator.match_prefix(compute_block_hashes([1, 2], 1))
    assert matched == [a, b]
    allocator.free([b])
    allocator.free([a])
    assert allocator.allocate(1) == [b]


def test_prefix_hit_returns_same_blocks_and_increments_refcount():
    allocator = BlockAllocator(8, block_size=4)
    tokens = list(range(10))
    blocks = fill_and_register(allocator, tokens)
    assert len(blocks) == 2

    hashes = compute_block_hashes(tokens + [99, 98], 4)
    matched = allocator.match_prefix(hashes)
    assert matched == blocks
    assert [allocator.refcount(b) for b in blocks] == [2, 2]

    allocator.free(blocks)
    allocator.free(matched)
    assert allocator.stats() == BlockStats(num_total=8, num_used=0, num_cached=2, num_free=6)
    assert allocator.match_prefix(hashes) == blocks
    assert [allocator.refcount(b) for b in blocks] == [1, 1]


def test_the_hit_counters_count_recorded_lookups_only():
    """What the router's stats line divides: hits over lookups, never above 100%. A match
    counts nothing by itself (the scheduler records a prompt's lookup once, at admission,
    however often it retries), nor does a fresh allocation."""
    allocator = BlockAllocator(8, block_size=4)
    blocks = fill_and_register(allocator, list(range(8)))
    matched = allocator.match_prefix(compute_block_hashes(list(range(8)) + [7] * 8, 4))
    assert matched == blocks
    allocator.allocate(3)
    assert (allocator.prefix_queried_blocks, allocator.prefix_hit_blocks) == (0, 0)
    allocator.record_prefix_lookup(4, 2)
    allocator.record_prefix_lookup(3, 0)
    assert (allocator.prefix_queried_blocks, allocator.prefix_hit_blocks) == (7, 2)
    with pytest.raises(ValueError, match="a lookup of 1 blocks cannot hit 2"):
        allocator.record_prefix_lookup(1, 2)


def test_prefix_match_stops_at_first_unregistered_hash():
    allocator = BlockAllocator(8, block_size=2)
    tokens = list(range(6))
    blocks = fill_and_register(allocator, tokens)
    hashes = compute_block_hashes(tokens, 2)
    assert allocator.match_prefix([hashes[0], 12345, hashes[2]]) == blocks[:1]
    assert allocator.match_prefix([]) == []


def test_registering_a_hash_held_by_another_block_keeps_the_first_block():
    allocator = BlockAllocator(4, block_size=2)
    a, b = allocator.allocate(2)
    allocator.register_full_block(a, 42)
    allocator.register_full_block(b, 42)
    assert allocator.block_hash(b) is None
    assert allocator.match_prefix([42]) == [a]
    allocator.free([b])
    assert allocator.stats().num_free == 3


def test_registering_a_different_hash_or_an_unreferenced_block_raises():
    allocator = BlockAllocator(4, block_size=2)
    a, b = allocator.allocate(2)
    allocator.register_full_block(a, 1)
    allocator.register_full_block(a, 1)
    with pytest.raises(ValueError, match=str(a)):
        allocator.register_full_block(a, 2)
    allocator.free([b])
    with pytest.raises(ValueError, match=str(b)):
        allocator.register_full_block(b, 3)


def test_hash_depends_on_earlier_blocks_not_only_the_last():
    first = compute_block_hashes([1, 2, 3, 4], 2)
    second = compute_block_hashes([9, 9, 3, 4], 2)
    assert first[0] != second[0]
    assert first[1] != second[1]


def test_extra_key_separates_identical_tokens():
    tokens = [5, 6, 7, 8]
    assert compute_block_hashes(tokens, 2, extra_key=1) != compute_block_hashes(tokens, 2)
    assert compute_block_hashes(tokens, 2, extra_key=1) != compute_block_hashes(
        tokens, 2, extra_key=2
    )


def test_same_tokens_hash_the_same_in_another_process():
    tokens = list(range(100, 116))
    expected = compute_block_hashes(tokens, 4, extra_key=7)
    assert expected == compute_block_hashes(tokens, 4, extra_key=7)
    out = run_python(
        "from common.engine.block_allocator import compute_block_hashes;"
        f"print(compute_block_hashes({tokens!r}, 4, extra_key=7))"
    )
    assert out == repr(expected)


def test_block_hashes_are_chained_block_hashes():
    tokens = [3, 1, 4, 1, 5, 9]
    h0 = hash_block_tokens(None, [3, 1])
    h1 = hash_block_tokens(h0, [4, 1])
    h2 = hash_block_tokens(h1, [5, 9])
    assert compute_block_hashes(tokens, 2) == [h0, h1, h2]


def test_trailing_partial_block_is_not_hashed():
    assert len(compute_block_hashes(list(range(11)), 4)) == 2
    assert compute_block_hashes(list(range(11)), 4) == compute_block_hashes(list(range(8)), 4)
    assert compute_block_hashes([1, 2, 3], 4) == []


def test_disabled_prefix_caching_never_matches_and_frees_straight_to_free_list():
    allocator = BlockAllocator(4, block_size=2, enable_prefix_caching=False)
    tokens = list(range(4))
    blocks = fill_and_register(allocator, tokens)
    assert all(allocator.block_hash(b) is None for b in blocks)
    assert allocator.match_prefix(compute_block_hashes(tokens, 2)) == []
    allocator.free(blocks)
    assert allocator.stats() == BlockStats(num_total=4, num_used=0, num_cached=0, num_free=4)


def test_reset_prefix_cache_frees_cached_blocks_and_forgets_hashes():
    allocator = BlockAllocator(4, block_size=2)
    cached = fill_and_register(allocator, [1, 2, 3, 4])
    allocator.free(cached)
    held = fill_and_register(allocator, [5, 6, 7, 8])

    allocator.reset_prefix_cache()
    assert allocator.stats() == BlockStats(num_total=4, num_used=2, num_cached=0, num_free=2)
    assert allocator.match_prefix(compute_block_hashes([1, 2, 3, 4], 2)) == []
    assert all(allocator.block_hash(b) is None for b in cached + held)
    allocator.free(held)
    assert allocator.stats().num_free == 4


def test_importing_block_allocator_does_not_import_torch():
    out = run_python("import sys, common.engine.block_allocator; print('torch' in sys.modules)")
    assert out == "False"
