"""The host side of a step: `model_runner.slots`, the KV slot of each position of a run."""

from __future__ import annotations

import random

import pytest

from common.engine import model_runner
from common.engine.model_runner import slots


def slot_per_position(blocks: list[int], block_size: int, start: int, end: int) -> list[int]:
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_slots_equal_the_per_position_rule_for_short_and_long_runs(block_size):
    """Both ways of building a run (a block's range at a time; numpy from
    NUMPY_SLOTS_MIN_BLOCKS blocks) give each position's block * block_size + offset, for runs
    starting and ending inside blocks, one position, and none."""
    rng = random.Random(block_size)
    blocks = rng.sample(range(10_000), 600)
    longest = (model_runner.NUMPY_SLOTS_MIN_BLOCKS + 3) * block_size
    cases = [(0, 0), (5, 6), (0, block_size), (3, longest), (block_size - 1, 2 * block_size + 1)]
    cases += [(s, s + rng.randrange(0, longest)) for s in rng.sample(range(200), 30)]
    for start, end in cases:
        assert slots(blocks, block_size, start, end) == slot_per_position(
            blocks, block_size, start, end
        ), (start, end)
    long_run = slots(blocks, block_size, 7, 7 + longest)
    assert all(type(s) is int for s in long_run)  # numpy's ints would slow later conversions
