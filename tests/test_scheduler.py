"""The scheduler driven by a fake model loop: real Scheduler + BlockAllocator, no torch.

Each step is what the engine does: `schedule()`, "run the model" (write the scheduled tokens
into a fake KV pool and pick a token for every row that samples), then `update()`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from common.engine.scheduler import SampledToken
from common.engine.sequence import FinishReason, Sequence, SequenceStatus
from tests.scheduler_helpers import (
    EOS,
    FILLER,
    REPO_ROOT,
    TokenChooser,
    always,
    make_scheduler,
    make_seq,
    rows,
    run_until_idle,
    step,
)

# -- continuous batching ----------------------------------------------------------------------


def test_new_request_joins_the_batch_while_another_decodes():
    scheduler = make_scheduler()
    a = make_seq("a", 20, max_tokens=10)
    scheduler.add(a)
    assert rows(step(scheduler)[0]) == [("a", 0, 20)]
    assert rows(step(scheduler)[0]) == [("a", 20, 1)]

    scheduler.add(make_seq("b", 30))
    batch = scheduler.schedule()
    assert rows(batch) == [("a", 21, 1), ("b", 0, 30)]
    assert all(item.samples for item in batch.items)  # read before update() appends tokens


def test_steps_respect_token_budget_and_sequence_limit_as_requests_stream_in():
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=40)
    seqs = [make_seq(f"r{i}", 5 + 7 * i, max_tokens=3 + i % 4) for i in range(10)]
    pending = list(seqs)
    mixed_steps = 0
    for _ in range(200):
        if pending:
            scheduler.add(pending.pop(0))
        elif not scheduler.has_work():
            break
        batch, _ = step(scheduler)
        assert batch.num_tokens <= 40
        assert len(batch.items) <= 3 and len(scheduler.running) <= 3
        sizes = {item.num_new_tokens for item in batch.items}
        mixed_steps += 1 in sizes and max(sizes) > 1
    assert not scheduler.has_work()
    assert mixed_steps > 0, "prefills never ran alongside decodes"
    for seq in seqs:
        assert seq.finish_reason is FinishReason.LENGTH
        assert len(seq.output_token_ids) == seq.params.max_tokens
    assert scheduler.allocator.stats().num_used == 0


def test_decodes_are_scheduled_before_new_prefills():
    scheduler = make_scheduler(max_num_batched_tokens=32)
    scheduler.add(make_seq("a", 10, max_tokens=5))
    step(scheduler)
    scheduler.add(make_seq("b", 40))
    scheduler.add(make_seq("c", 40))
    batch, _ = step(scheduler)
    # b's prompt alone could fill the budget, but a's decode goes first.
    assert rows(batch) == [("a", 10, 1), ("b", 0, 31)]
    assert [s.request_id for s in scheduler.waiting] == ["c"]


# -- chunked prefill --------------------------------------------------------------------------


def test_long_prompt_is_split_over_steps_and_samples_only_on_its_last_chunk():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    seq = make_seq("a", 40, max_tokens=2)
    scheduler.add(seq)
    seen = []
    for _ in range(3):
        batch = scheduler.schedule()
        (item,) = batch.items
        seen.append((item.start, item.num_new_tokens, item.samples))
        scheduler.update(batch, [SampledToken(FILLER) if item.samples else None])
        assert seq.num_computed_tokens == item.start + item.num_new_tokens
    assert seen == [(0, 16, False), (16, 16, False), (32, 8, True)]
    assert seq.output_token_ids == [FILLER]
    assert rows(step(scheduler)[0]) == [("a", 40, 1)]
    assert seq.finish_reason is FinishReason.LENGTH


def test_unsampled_chunk_row_accepts_no_token():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    scheduler.add(make_seq("a", 40))
    batch = scheduler.schedule()
    assert not batch.items[0].samples
    scheduler.update(batch, [None])
    assert scheduler.running[0].output_token_ids == []


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits_whole():
    scheduler = make_scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False)
    a = make_seq("a", 10, max_model_len=32, max_tokens=3)
    b = make_seq("b", 32, max_model_len=32, max_tokens=1)
    scheduler.add(a)
    step(scheduler)
    scheduler.add(b)
    # a's decode leaves 31 tokens of budget: b waits, unsplit and holding no blocks.
    assert rows(step(scheduler)[0]) == [("a", 10, 1)]
    assert b.status is SequenceStatus.WAITING
    assert (b.num_computed_tokens, b.block_ids) == (0, [])
    run_until_idle(scheduler)
    assert b.finish_reason is FinishReason.LENGTH


def test_without_chunked_prefill_a_waiting_prompt_keeps_later_ones_behind_it():
    scheduler = make_scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False)
    scheduler.add(make_seq("a", 10, max_model_len=32, max_tokens=3))
    step(scheduler)
    scheduler.add(make_seq("b", 32, max_model_len=32))
    scheduler.add(make_seq("c", 2, max_model_len=32))
    assert rows(step(scheduler)[0]) == [("a", 10, 1)]
    assert [s.request_id for s in scheduler.waiting] == ["b", "c"]


def test_without_chunked_prefill_add_rejects_a_prompt_longer_than_the_step_budget():
    scheduler = make_scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens=32"):
        scheduler.add(make_seq("a", 33))
    assert not scheduler.has_work()


# -- preemption -------------------------------------------------------------------------------


ABC = [("a", 8), ("b", 8), ("c", 6)]


def test_pool_exhaustion_preempts_the_latest_arrival_and_requeues_it_first():
    # 6 blocks of 4 tokens. a and b (8 tokens) each need a third block to decode; c (6 tokens)
    # still has room, but it arrived last, so it is the one preempted.
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    a, b, c = (make_seq(n, p, max_model_len=24, max_tokens=8) for n, p in ABC)
    for seq in (a, b, c):
        scheduler.add(seq)
    step(scheduler)
    assert scheduler.allocator.stats().num_free == 0
    d = make_seq("d", 4, max_model_len=24)
    scheduler.add(d)

    batch, _ = step(scheduler)
    assert batch.preempted == [c]
    assert scheduler.running == [a, b]
    assert rows(batch) == [("a", 8, 1), ("b", 8, 1)]  # nothing admitted on a short step
    assert list(scheduler.waiting) == [c, d]
    assert c.status is SequenceStatus.WAITING
    assert (c.block_ids, c.num_computed_tokens, c.num_preemptions) == ([], 0, 1)
    assert c.output_token_ids == [FILLER]  # its output survives; only its KV is recomputed
    assert scheduler.allocator.stats().num_used == len(a.block_ids) + len(b.block_ids) == 6

    run_until_idle(scheduler)
    for seq in (a, b, c, d):
        assert seq.finish_reason is FinishReason.LENGTH
        assert len(seq.output_token_ids) == seq.params.max_tokens
    assert scheduler.allocator.stats().num_used == 0


def test_a_preempted_request_recovers_its_cached_full_blocks():
    # 7 blocks of 4: a, b and c (8 tokens each) take 6. a's decode takes the last free block,
    # b's preempts c, whose two full blocks become cached; b then evicts c's tail, not its head.
    scheduler = make_scheduler(num_blocks=7, block_size=4)
    a, b = (make_seq(n, 8, max_model_len=28, max_tokens=2) for n in "ab")
    c = make_seq("c", 8, max_model_len=28, max_tokens=8)
    for seq in (a, b, c):
        scheduler.add(seq)
    step(scheduler)
    batch, finished = step(scheduler)
    assert batch.preempted == [c] and finished == [a, b]

    batch, _ = step(scheduler)
    assert rows(batch) == [("c", 4, 5)]
    assert c.num_cached_tokens == 4
    run_until_idle(scheduler)
    assert len(c.output_token_ids) == 8


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_memory_pressure_never_raises_and_every_request_gets_all_its_tokens(
    enable_prefix_caching,
):
    scheduler = make_scheduler(
        num_blocks=10, block_size=4, max_num_seqs=6, enable_prefix_caching=enable_prefix_caching
    )
    seqs = [
        make_seq(f"r{i}", 3 + 2 * i, max_model_len=40, max_tokens=12, ignore_eos=True)
        for i in range(8)
    ]
    for seq in seqs:
        scheduler.add(seq)
    batches = run_until_idle(scheduler, always(EOS))
    assert any(batch.preempted for batch in batches)
    for seq in seqs:
        assert seq.finish_reason is FinishReason.LENGTH
        assert seq.output_token_ids == [EOS] * 12
    assert scheduler.allocator.stats().num_used == 0


def test_waiting_request_never_pins_cached_blocks_a_preempted_request_needs():
    # Regression: a waiting request used to keep its prefix hits while it waited for memory.
    # Here w pins s0's two cached blocks, r1 (alone, growing) preempts itself, and r1 + w then
    # held the whole pool between them with nothing running: every later step was empty.
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    shared = list(range(100, 108))
    scheduler.add(make_seq("s0", shared, max_model_len=24, max_tokens=1))
    run_until_idle(scheduler)
    assert scheduler.allocator.stats().num_cached == 2

    r1 = make_seq("r1", 4, max_model_len=24, max_tokens=19)
    scheduler.add(r1)
    while len(r1.block_ids) < 4:
        step(scheduler)
    w = make_seq("w", [*shared, 1], max_model_len=24, max_tokens=1)
    scheduler.add(w)
    step(scheduler)
    assert w.status is SequenceStatus.WAITING and w.block_ids == []

    run_until_idle(scheduler, max_steps=100)
    assert len(r1.output_token_ids) == 19 and len(w.output_token_ids) == 1
    assert scheduler.allocator.stats().num_used == 0


def test_without_chunked_prefill_add_rejects_a_request_that_could_outgrow_the_step_budget():
    scheduler = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="chunked prefill is off"):
        scheduler.add(make_seq("a", 10, max_model_len=40, max_tokens=28))


# -- prefix caching ---------------------------------------------------------------------------


def test_same_40_token_prompt_reuses_two_full_blocks_and_computes_the_rest():
    scheduler = make_scheduler(block_size=16)
    prompt = list(range(500, 540))
    a, b = make_seq("a", prompt), make_seq("b", prompt)
    scheduler.add(a)
    step(scheduler)
    scheduler.add(b)
    batch, _ = step(scheduler)
    assert rows(batch) == [("a", 40, 1), ("b", 32, 8)]
    assert b.num_cached_tokens == 32
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] != a.block_ids[2]  # the partial block is private
    assert [scheduler.allocator.refcount(x) for x in b.block_ids] == [2, 2, 1]

    run_until_idle(scheduler)
    stats = scheduler.allocator.stats()
    assert stats.num_used == 0 and stats.num_cached >= 2


def test_shared_prompt_of_exactly_two_blocks_reuses_one_so_a_token_is_computed():
    scheduler = make_scheduler(block_size=16)
    prompt = list(range(500, 532))
    scheduler.add(make_seq("a", prompt))
    step(scheduler)
    b = make_seq("b", prompt)
    scheduler.add(b)
    batch = scheduler.schedule()
    assert rows(batch)[1] == ("b", 16, 16)
    assert batch.items[1].samples
    assert b.num_cached_tokens == 16


def test_finished_request_leaves_its_blocks_cached_for_a_later_one():
    scheduler = make_scheduler(block_size=16)
    prompt = list(range(500, 540))
    a = make_seq("a", prompt)
    scheduler.add(a)
    run_until_idle(scheduler)
    assert a.block_ids == []
    assert scheduler.allocator.stats().num_cached == 2  # 40 prompt + 3 computed outputs

    b = make_seq("b", prompt)
    scheduler.add(b)
    assert rows(step(scheduler)[0]) == [("b", 32, 8)]
    assert b.num_cached_tokens == 32


def test_a_prefix_lookup_counts_once_however_often_its_admission_is_retried():
    """The hit counters the router's stats line divides: a waiting prompt whose blocks do not
    fit gives its cached match back and looks it up again at every step; only the lookup of
    the admission that succeeds counts."""
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    allocator = scheduler.allocator
    shared = list(range(100, 108))
    scheduler.add(make_seq("s0", shared, max_tokens=1))
    run_until_idle(scheduler)
    assert allocator.stats().num_cached == 2
    counted = (allocator.prefix_queried_blocks, allocator.prefix_hit_blocks)

    held = allocator.allocate(4)  # the rest of the pool, e.g. running requests
    w = make_seq("w", [*shared, 1, 2, 3, 4, 5])  # 13 tokens: 2 cached blocks + 2 new ones
    scheduler.add(w)
    for _ in range(5):
        assert not scheduler.schedule()
    assert (allocator.prefix_queried_blocks, allocator.prefix_hit_blocks) == counted

    allocator.free(held)
    assert rows(scheduler.schedule()) == [("w", 8, 5)]
    looked_up, found = (13 - 1) // 4, 2  # the last token is always computed
    assert allocator.prefix_queried_blocks == counted[0] + looked_up
    assert allocator.prefix_hit_blocks == counted[1] + found


def test_without_prefix_caching_identical_prompts_share_nothing():
    scheduler = make_scheduler(block_size=16, enable_prefix_caching=False)
    prompt = list(range(500, 540))
    a, b = make_seq("a", prompt), make_seq("b", prompt)
    scheduler.add(a)
    step(scheduler)
    scheduler.add(b)
    assert rows(step(scheduler)[0])[1] == ("b", 0, 40)
    assert b.num_cached_tokens == 0 and not set(a.block_ids) & set(b.block_ids)
    run_until_idle(scheduler)
    assert scheduler.allocator.stats().num_cached == 0


# -- abort ------------------------------------------------------------------------------------


def test_abort_of_a_running_request_frees_its_blocks_but_not_shared_ones():
    scheduler = make_scheduler(block_size=16)
    prompt = list(range(500, 540))
    a, b = make_seq("a", prompt), make_seq("b", prompt)
    scheduler.add(a)
    step(scheduler)
    scheduler.add(b)
    step(scheduler)
    held = list(b.block_ids)

    assert scheduler.abort("b") is b
    assert b.finish_reason is FinishReason.ABORT and b.is_finished and b.block_ids == []
    assert scheduler.running == [a]
    assert [scheduler.allocator.refcount(x) for x in held] == [1, 1, 0]
    assert scheduler.abort("a") is a
    assert scheduler.allocator.stats().num_used == 0
    assert not scheduler.has_work()


def test_abort_of_a_waiting_request_removes_it_and_leaves_the_pool_alone():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(make_seq("a", 20))
    step(scheduler)
    b = make_seq("b", 20)
    scheduler.add(b)
    step(scheduler)
    before = scheduler.allocator.stats()
    assert scheduler.abort("b") is b
    assert b.finish_reason is FinishReason.ABORT and not scheduler.waiting
    assert scheduler.allocator.stats() == before


def test_abort_of_a_preempted_request_leaves_no_blocks_behind():
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    seqs = [make_seq(n, p, max_model_len=24, max_tokens=8) for n, p in ABC]
    for seq in seqs:
        scheduler.add(seq)
    step(scheduler)
    (victim,) = step(scheduler)[0].preempted
    assert scheduler.abort(victim.request_id) is victim
    run_until_idle(scheduler)
    assert scheduler.allocator.stats().num_used == 0


def test_abort_while_the_step_runs_drops_that_rows_result():
    scheduler = make_scheduler()
    a, b = make_seq("a", 20), make_seq("b", 20)
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()
    scheduler.abort("a")
    finished = scheduler.update(batch, [SampledToken(FILLER), SampledToken(FILLER)])
    assert finished == []
    assert a.output_token_ids == [] and a.block_ids == []
    assert b.output_token_ids == [FILLER]
    assert scheduler.running == [b]


def test_abort_of_an_unknown_request_returns_none():
    scheduler = make_scheduler()
    scheduler.add(make_seq("a", 5))
    assert scheduler.abort("nope") is None
    assert scheduler.has_work()


# -- finish reasons ---------------------------------------------------------------------------


def finish(seq: Sequence, choose: TokenChooser, **config: object) -> Sequence:
    scheduler = make_scheduler(**config)  # type: ignore[arg-type]
    scheduler.add(seq)
    run_until_idle(scheduler, choose)
    assert seq.block_ids == [] and scheduler.allocator.stats().num_used == 0
    return seq


def test_max_tokens_finishes_with_length():
    seq = finish(make_seq("a", 5, max_tokens=3), always(FILLER))
    assert (seq.finish_reason, seq.output_token_ids) == (FinishReason.LENGTH, [FILLER] * 3)


def test_eos_finishes_with_stop():
    seq = finish(make_seq("a", 5, max_tokens=10), lambda s: EOS if s.output_token_ids else 9)
    assert (seq.finish_reason, seq.output_token_ids) == (FinishReason.STOP, [9, EOS])


def test_ignore_eos_runs_to_max_tokens():
    seq = finish(make_seq("a", 5, max_tokens=4, ignore_eos=True), always(EOS))
    assert (seq.finish_reason, seq.output_token_ids) == (FinishReason.LENGTH, [EOS] * 4)


def test_stop_token_id_finishes_with_stop_and_records_it():
    seq = finish(make_seq("a", 5, max_tokens=10, stop_token_ids=[42]), always(42))
    assert (seq.finish_reason, seq.stop_reason, seq.output_token_ids) == (
        FinishReason.STOP,
        42,
        [42],
    )


def test_context_limit_finishes_with_length():
    seq = finish(make_seq("a", 10, max_model_len=13, max_tokens=None), always(FILLER))
    assert seq.finish_reason is FinishReason.LENGTH
    assert (seq.num_tokens, len(seq.output_token_ids)) == (13, 3)


def test_min_tokens_delays_stopping_on_eos():
    seq = finish(make_seq("a", 5, max_tokens=10, min_tokens=3), always(EOS))
    assert (seq.finish_reason, seq.output_token_ids) == (FinishReason.STOP, [EOS] * 3)


# -- admission --------------------------------------------------------------------------------


def test_add_rejects_a_request_that_could_never_fit_in_the_pool():
    scheduler = make_scheduler(num_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="needs 5 KV blocks, the pool has 4"):
        scheduler.add(make_seq("a", 64))  # 64 prompt tokens + 1 to sample = 5 blocks
    assert not scheduler.has_work()
    scheduler.add(make_seq("b", 63))
    assert scheduler.has_work()


# -- packaging --------------------------------------------------------------------------------


# -- sequences whose KV arrived from a prefill node (decode node) -----------------------------


def transferred(scheduler, request_id: str, prompt_len: int, **params: object) -> Sequence:
    """A sequence as the decode node admits it: prompt KV in reserved blocks, first token out."""
    seq = make_seq(request_id, prompt_len, **params)
    seq.block_ids = scheduler.allocator.allocate(scheduler.blocks_for(prompt_len))
    seq.num_computed_tokens = prompt_len
    seq.output_token_ids.append(FILLER)
    scheduler.add_running(seq)
    return seq


def test_transferred_sequences_never_run_more_than_max_num_seqs_at_once():
    # A decode node fed by several prefill nodes: admissions beyond max_num_seqs wait (with
    # their blocks) instead of growing the batch past the largest captured CUDA graph.
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = [transferred(scheduler, f"r{i}", 20, max_tokens=3) for i in range(3)]
    batch, _ = step(scheduler)
    assert rows(batch) == [("r0", 20, 1), ("r1", 20, 1)]
    assert list(scheduler.ready) == [seqs[2]] and seqs[2].block_ids  # holds its KV
    batches = run_until_idle(scheduler)
    assert max(len(b.items) for b in [batch, *batches]) == 2
    assert all(len(s.output_token_ids) == 3 for s in seqs)
    assert scheduler.allocator.stats().num_used == 0


def test_a_transferred_sequence_is_admitted_before_waiting_prompts():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(make_seq("local", 8))
    transferred(scheduler, "remote", 8)
    batch, _ = step(scheduler)
    assert [item.seq.request_id for item in batch.items] == ["remote"]


def test_abort_of_a_sequence_waiting_to_run_frees_its_blocks():
    scheduler = make_scheduler(max_num_seqs=1)
    transferred(scheduler, "a", 20)
    b = transferred(scheduler, "b", 40)
    step(scheduler)
    held = scheduler.allocator.stats().num_used
    assert scheduler.abort("b") is b and b.finish_reason is FinishReason.ABORT
    assert scheduler.allocator.stats().num_used == held - 3 and not scheduler.ready


def test_importing_the_scheduler_does_not_import_torch():
    code = "import sys, common.engine.scheduler; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
