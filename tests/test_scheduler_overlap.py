"""The scheduler under the overlapped loop, pure Python: step N+1 is scheduled and committed
before step N's tokens are resolved (`commit` / `resolve` one step apart, as EngineCore does).

The fake loop mirrors `EngineCore.step` in overlap mode; the checks: the same tokens and finish
reasons as the synchronous loop, placeholders never leak, a sequence that stops at step N loses
its row of step N+1, blocks of finished sequences are held while a step that may write them is
in flight.
"""

from __future__ import annotations

from common.engine.scheduler import SampledToken, ScheduledBatch, Scheduler
from common.engine.sequence import PLACEHOLDER, FinishReason, Sequence
from tests.scheduler_helpers import EOS, FILLER, make_scheduler, make_seq, run_until_idle


def choose_by_position(seq: Sequence, index: int) -> int:
    """A deterministic 'model': the token depends only on the request and output position."""
    if seq.request_id == "stopper" and index == 2:
        return EOS
    return FILLER + (index % 3)


def sample(batch: ScheduledBatch) -> list[SampledToken | None]:
    return [
        SampledToken(choose_by_position(item.seq, index)) if index is not None else None
        for item, index in zip(batch.items, batch.output_index, strict=True)
    ]


def run_overlapped(scheduler: Scheduler, max_steps: int = 500) -> list[list[int]]:
    """EngineCore's overlapped step with a fake model; returns each step's held blocks."""
    in_flight: tuple[ScheduledBatch, list] | None = None
    held_log = []
    for _ in range(max_steps):
        if not scheduler.has_work() and in_flight is None:
            return held_log
        batch = scheduler.schedule()
        held = scheduler.take_held()
        launched = None
        if batch:
            tokens = sample_pending(batch)  # the "device" samples at launch
            scheduler.commit(batch)
            scheduler.hold_frees = True
            launched = (batch, tokens)
        if in_flight is not None:
            scheduler.resolve(*in_flight)
        scheduler.allocator.free(held)
        held_log.append(held)
        in_flight = launched
        if in_flight is None:
            scheduler.hold_frees = False
            scheduler.allocator.free(scheduler.take_held())
    raise AssertionError("still busy")


def sample_pending(batch: ScheduledBatch) -> list[SampledToken | None]:
    # At launch the output index of a sampling row is the current output length.
    return [
        SampledToken(choose_by_position(item.seq, len(item.seq.output_token_ids)))
        if item.samples
        else None
        for item in batch.items
    ]


def requests() -> list[Sequence]:
    return [
        make_seq("stopper", 20, max_tokens=10),  # EOS at its third token
        make_seq("short", 33, max_tokens=2),
        make_seq("long", 50, max_tokens=9, min_tokens=3),
        make_seq("tiny", 1, max_tokens=1),
    ]


def test_overlapped_steps_give_the_synchronous_tokens_and_reasons():
    sync, overlapped = (
        make_scheduler(max_num_batched_tokens=40),
        make_scheduler(max_num_batched_tokens=40),
    )
    a, b = requests(), requests()
    for seq in a:
        sync.add(seq)
    for seq in b:
        overlapped.add(seq)
    run_until_idle(sync, lambda seq: choose_by_position(seq, len(seq.output_token_ids)))
    run_overlapped(overlapped)
    for x, y in zip(a, b, strict=True):
        assert y.output_token_ids == x.output_token_ids
        assert PLACEHOLDER not in y.output_token_ids
        assert y.finish_reason == x.finish_reason
    assert [s.finish_reason for s in b] == [
        FinishReason.STOP,
        FinishReason.LENGTH,
        FinishReason.LENGTH,
        FinishReason.LENGTH,
    ]
    assert overlapped.allocator.stats().num_used == 0


def test_a_sequence_that_stops_loses_its_row_of_the_step_in_flight():
    scheduler = make_scheduler()
    seq = make_seq("stopper", 4, max_tokens=10)
    scheduler.add(seq)
    batches = []
    for _ in range(3):  # prefill, then two decodes (tokens 0, 1 and 2 launched)
        batch = scheduler.schedule()
        tokens = sample_pending(batch)
        scheduler.commit(batch)
        batches.append((batch, tokens))
        if len(batches) > 1:
            scheduler.resolve(*batches[-2])
    assert seq.output_token_ids == [FILLER, FILLER + 1, PLACEHOLDER]
    scheduler.hold_frees = True
    batch = scheduler.schedule()  # step 3 launched before step 2 (the EOS) is known
    scheduler.commit(batch)
    assert seq.output_token_ids[-2:] == [PLACEHOLDER, PLACEHOLDER]
    assert scheduler.resolve(*batches[-1]) == [seq]
    assert seq.output_token_ids == [FILLER, FILLER + 1, EOS]  # the extra row is dropped
    assert scheduler.resolve(batch, sample_pending(batch)) == []
    held = scheduler.take_held()
    assert held and scheduler.allocator.stats().num_used == len(held)  # held, not yet free
    scheduler.allocator.free(held)
    assert scheduler.allocator.stats().num_used == 0


def test_a_sequence_whose_unresolved_token_is_its_last_is_not_scheduled_again():
    scheduler = make_scheduler()
    seq = make_seq("a", 4, max_tokens=2)
    scheduler.add(seq)
    for _ in range(2):
        batch = scheduler.schedule()
        scheduler.commit(batch)
    # Two placeholders: the second is its max_tokens-th token, whatever it turns out to be.
    assert seq.output_token_ids == [PLACEHOLDER, PLACEHOLDER]
    assert seq.awaiting_last_token
    assert not scheduler.schedule()


def test_finished_blocks_are_held_only_while_a_step_is_in_flight():
    scheduler = make_scheduler()
    a, b = make_seq("a", 20), make_seq("b", 20)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.commit(scheduler.schedule())
    scheduler.hold_frees = True
    scheduler.abort("a")
    assert scheduler.allocator.stats().num_used == 4  # a's two blocks are held
    held = scheduler.take_held()
    assert len(held) == 2 and scheduler.take_held() == []
    scheduler.allocator.free(held)
    scheduler.hold_frees = False
    scheduler.abort("b")
    assert scheduler.allocator.stats().num_used == 0 and scheduler.take_held() == []


def test_a_sequence_preempted_while_its_step_runs_resolves_from_the_waiting_queue():
    # Room for two sequences' prompts; growth forces the later one out while step N runs.
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    first, second = make_seq("first", 8, max_tokens=6), make_seq("second", 8, max_tokens=1)
    scheduler.add(first)
    scheduler.add(second)
    batch = scheduler.schedule()
    tokens = sample_pending(batch)
    scheduler.commit(batch)
    grow = scheduler.schedule()  # first grows into a third block: second is preempted
    assert grow.preempted == [second] and second in scheduler.waiting
    scheduler.commit(grow)
    finished = scheduler.resolve(batch, tokens)
    assert second in finished and second.finish_reason is FinishReason.LENGTH
    assert second not in scheduler.waiting and PLACEHOLDER not in second.output_token_ids
    assert first.output_token_ids[0] == FILLER and first.output_token_ids[1] == PLACEHOLDER


def test_overlapped_runs_with_preemption_finish_everything_and_free_every_block():
    scheduler = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=16)
    seqs = [make_seq(f"r{i}", 5 + i, max_tokens=6 + i) for i in range(5)]
    for seq in seqs:
        scheduler.add(seq)
    run_overlapped(scheduler)
    assert all(s.is_finished and PLACEHOLDER not in s.output_token_ids for s in seqs)
    assert [len(s.output_token_ids) for s in seqs] == [6, 7, 8, 9, 10]
    assert scheduler.allocator.stats().num_used == 0
