"""n > 1: samples forked on the parent's prompt blocks (reference counts, no copy), the
decode node's per-request sample bookkeeping (decode_node/choices.py), and no block leaked whatever ends first."""

from __future__ import annotations

from common.engine.scheduler import SampledToken
from common.protocol.messages import DecodeRequest
from decode_node import choices
from decode_node.request import DecodeTiming, Phase, Request
from tests.scheduler_helpers import make_scheduler, make_seq, rows, run_until_idle, step


def prefilled_parent(scheduler, prompt_len: int, n: int = 3, **params):
    parent = make_seq("r", prompt_len, n=n, **params)
    scheduler.add(parent)
    batch = scheduler.schedule()  # the whole prompt in one step
    return parent, batch


def record(seq) -> Request:
    """The decode node's record of `seq`'s request, running (as after accept, colocated)."""
    message = DecodeRequest(seq.request_id, seq.prompt_token_ids, seq.params, None)
    req = Request(message, seq, DecodeTiming(), phase=Phase.RUNNING)
    req.samples.add(seq.request_id)
    return req


def test_children_share_the_full_prompt_blocks_and_compute_only_the_tail():
    scheduler = make_scheduler(block_size=16)
    parent, batch = prefilled_parent(scheduler, 40)  # blocks 0, 1 full; 2 holds 8 tokens
    req = record(parent)
    children = choices.fork(scheduler, req, parent)
    assert [c.request_id for c in children] == ["r#1", "r#2"] and [c.index for c in children] == [
        1,
        2,
    ]
    shared = parent.block_ids[:2]
    for child in children:
        assert child.block_ids == shared and child.num_computed_tokens == 32
    allocator = scheduler.allocator
    assert [allocator.refcount(b) for b in shared] == [3, 3]
    assert allocator.refcount(parent.block_ids[2]) == 1  # the partial block is the parent's own
    scheduler.update(batch, [_token()])  # the parent samples its first token
    next_batch = scheduler.schedule()
    assert ("r#1", 32, 8) in rows(next_batch) and ("r#2", 32, 8) in rows(next_batch)
    assert choices.fork(scheduler, req, parent) == []  # once per request


def test_samples_get_their_own_seeds_and_a_short_prompt_shares_nothing():
    scheduler = make_scheduler(block_size=16)
    parent, _ = prefilled_parent(scheduler, 10, seed=7)
    children = choices.fork(scheduler, record(parent), parent)
    assert [c.params.seed for c in children] == [8, 9]
    assert all(c.block_ids == [] and c in scheduler.waiting for c in children)


def test_every_block_is_free_again_when_all_samples_end_in_any_order():
    scheduler = make_scheduler(block_size=16, num_blocks=32, enable_prefix_caching=False)
    parent, batch = prefilled_parent(scheduler, 50, n=4, max_tokens=6)
    req = record(parent)
    children = choices.fork(scheduler, req, parent)
    scheduler.update(batch, [_token()])
    step(scheduler)
    aborted = scheduler.abort(children[1].request_id)  # the router stopped one sample early
    assert aborted is not None and not choices.sample_ended(req, aborted)
    run_until_idle(scheduler)
    ended = [choices.sample_ended(req, s) for s in (parent, children[0], children[2])]
    assert ended == [False, False, True]
    assert scheduler.allocator.stats().num_used == 0


def test_a_requests_record_lists_its_live_samples():
    scheduler = make_scheduler()
    parent, _ = prefilled_parent(scheduler, 40, n=3)
    req = record(parent)
    choices.fork(scheduler, req, parent)
    assert sorted(req.samples) == ["r", "r#1", "r#2"]  # the request id first
    single = make_seq("s", 20)
    one = record(single)
    assert choices.fork(scheduler, one, single) == [] and sorted(one.samples) == ["s"]
    assert choices.sample_ended(one, single) and not one.samples


def _token() -> SampledToken:
    return SampledToken(7)
