"""Randomized soak of the scheduler: random arrivals, shared prefixes, aborts (also while a
step runs) and a small pool; block accounting is checked against a fake KV store every step."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from common.engine.block_allocator import BlockAllocator
from common.engine.scheduler import SampledToken, ScheduledBatch, Scheduler
from common.engine.sequence import FinishReason, Sequence, SequenceStatus
from tests.scheduler_helpers import (
    EOS,
    make_scheduler,
    make_seq,
)

# -- randomized soak --------------------------------------------------------------------------


class FakeKV:
    """What a model would have written into each block, to check prefix hits are real."""

    def __init__(self, allocator: BlockAllocator) -> None:
        self.block_size = allocator.block_size
        self.slots: dict[int, list[int | None]] = {}

    def write(self, batch: ScheduledBatch) -> None:
        for item in batch.items:
            seq = item.seq
            for pos in range(item.start, item.start + item.num_new_tokens):
                block = self.slots.setdefault(
                    seq.block_ids[pos // self.block_size], [None] * self.block_size
                )
                block[pos % self.block_size] = seq.token_at(pos)

    def check(self, seq: Sequence) -> None:
        for pos in range(seq.num_computed_tokens):
            block = self.slots[seq.block_ids[pos // self.block_size]]
            assert block[pos % self.block_size] == seq.token_at(pos), (seq.request_id, pos)


def assert_invariants(scheduler: Scheduler, kv: FakeKV) -> None:
    allocator, bs = scheduler.allocator, scheduler.block_size
    live = [*scheduler.running, *scheduler.waiting]
    assert len({id(s) for s in live}) == len(live)
    assert all(s.status is SequenceStatus.RUNNING for s in scheduler.running)
    assert all(s.status is SequenceStatus.WAITING for s in scheduler.waiting)
    assert len(scheduler.running) <= scheduler.config.max_num_seqs

    holders = Counter(b for s in live for b in s.block_ids)
    for block in range(allocator.num_blocks):
        assert allocator.refcount(block) == holders[block], block
    stats = allocator.stats()
    assert stats.num_used == len(holders)
    assert stats.num_used + stats.num_cached + stats.num_free == stats.num_total

    for seq in scheduler.waiting:  # waiting sequences hold nothing between steps
        assert (seq.block_ids, seq.num_computed_tokens) == ([], 0)
    for seq in scheduler.running:
        assert len(seq.block_ids) == len(set(seq.block_ids))
        assert len(seq.block_ids) == scheduler.blocks_for(seq.num_computed_tokens)
        assert 0 < seq.num_pending_tokens
        kv.check(seq)

    # A block shared by several sequences is a registered prefix block at the same index in
    # each, and at most one of them computed it; the others got it from a prefix hit.
    for block, count in holders.items():
        if count == 1:
            continue
        assert allocator.block_hash(block) is not None
        positions = {s.block_ids.index(block) for s in live if block in s.block_ids}
        assert len(positions) == 1
        computed_it = [
            s
            for s in live
            if block in s.block_ids and s.block_ids.index(block) >= s.num_cached_tokens // bs
        ]
        assert len(computed_it) <= 1


def check_finished(seq: Sequence) -> None:
    assert seq.block_ids == []
    n_out = len(seq.output_token_ids)
    if seq.finish_reason is FinishReason.LENGTH:
        assert n_out == seq.params.max_tokens or seq.num_tokens == seq.max_model_len
    elif seq.finish_reason is FinishReason.STOP:
        assert seq.output_token_ids[-1] == EOS and n_out >= seq.params.min_tokens
    else:
        assert seq.finish_reason is FinishReason.ABORT


@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_keeps_block_accounting_exact_and_drains_to_zero(seed):
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    num_blocks = rng.randint(8, 24)
    chunked = rng.random() < 0.75
    budget = rng.randint(8, 48)
    scheduler = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=rng.random() < 0.8,
    )
    # As the engine does: the context never outgrows the pool, nor (unchunked) one step.
    max_model_len = num_blocks * block_size if chunked else min(num_blocks * block_size, budget)
    kv = FakeKV(scheduler.allocator)
    stems = [[rng.randrange(3, 60) for _ in range(40)] for _ in range(3)]
    live: list[Sequence] = []
    done: list[Sequence] = []
    next_id = 0

    def arrive() -> None:
        nonlocal next_id
        length = rng.randint(1, max_model_len - 1)
        cut = rng.randint(0, length)
        prompt = rng.choice(stems)[:cut]
        prompt += [rng.randrange(3, 60) for _ in range(length - len(prompt))]
        max_tokens = rng.randint(1, 24)
        seq = make_seq(
            f"r{next_id}",
            prompt,
            max_model_len=max_model_len,
            max_tokens=max_tokens,
            min_tokens=min(max_tokens, rng.choice([0, 0, 2])),  # SamplingParams: min <= max
            ignore_eos=rng.random() < 0.3,
        )
        next_id += 1
        scheduler.add(seq)
        live.append(seq)

    def abort_one() -> None:
        candidates = [s for s in live if not s.is_finished]
        seq = rng.choice(candidates) if candidates and rng.random() < 0.9 else None
        request_id = seq.request_id if seq else "unknown"
        assert scheduler.abort(request_id) is seq

    def choose(seq: Sequence) -> int:
        return EOS if rng.random() < 0.05 else rng.randrange(3, 60)

    for step_index in range(3000):
        arriving = step_index < 250
        if arriving and rng.random() < 0.4:
            arrive()
        if arriving and rng.random() < 0.05:
            abort_one()
        if not scheduler.has_work():
            if arriving:
                continue
            break
        batch = scheduler.schedule()
        assert batch, "scheduler has work but scheduled nothing"
        assert batch.num_tokens <= budget
        assert all(item.num_new_tokens > 0 for item in batch.items)
        if not chunked:
            assert all(item.samples for item in batch.items)
        kv.write(batch)
        if rng.random() < 0.03:
            abort_one()  # lands while the model runs
        sampled = [SampledToken(choose(item.seq)) if item.samples else None for item in batch.items]
        scheduler.update(batch, sampled)
        for seq in [s for s in live if s.is_finished]:
            live.remove(seq)
            done.append(seq)
            check_finished(seq)
        assert_invariants(scheduler, kv)

    assert not scheduler.has_work() and not live
    assert next_id > 20 and len(done) == next_id
    assert scheduler.allocator.stats().num_used == 0
