"""Routing node events to per-request queues by request id."""

from __future__ import annotations

import asyncio

import pytest

from common.messages import FirstToken, Heartbeat, RequestError, TokenBatch, TokenOutput
from router.events import EventRouter, NodeLost


def output(request_id: str, tokens: list[int], finished: bool = False) -> dict:
    return {
        "request_id": request_id,
        "token_ids": tokens,
        "logprobs": None,
        "top_logprobs": None,
        "finished": finished,
        "finish_reason": "stop" if finished else None,
        "timing": None,
    }


def drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def test_events_reach_only_their_request():
    router = EventRouter()
    qa, qb = router.open("a", ["p", "d"]), router.open("b", ["p", "d"])
    first = FirstToken("a", 7, None, None, False, None, 0, {})
    assert router.deliver(first) == 1
    assert router.deliver(RequestError("b", "boom", 500)) == 1
    assert drain(qa) == [first]
    assert drain(qb) == [RequestError("b", "boom", 500)]


def test_a_token_batch_is_split_per_request():
    router = EventRouter()
    qa, qb = router.open("a", ["d"]), router.open("b", ["d"])
    batch = TokenBatch([output("a", [1, 2]), output("b", [3], finished=True), output("x", [4])])
    assert router.deliver(batch) == 2
    assert [o.token_ids for o in drain(qa)] == [[1, 2]]
    (b_out,) = drain(qb)
    assert isinstance(b_out, TokenOutput) and b_out.finished


def test_events_for_unknown_or_closed_requests_are_dropped():
    router = EventRouter()
    queue = router.open("a", ["d"])
    router.close("a")
    assert router.deliver(TokenBatch([output("a", [1])])) == 0
    assert router.deliver(RequestError("never-seen", "x", 500)) == 0
    assert drain(queue) == []


def test_a_malformed_output_does_not_hide_the_others():
    router = EventRouter()
    queue = router.open("a", ["d"])
    bad = {**output("b", [1]), "token_ids": "nope"}
    assert router.deliver(TokenBatch([bad, output("a", [5])])) == 1
    assert [o.token_ids for o in drain(queue)] == [[5]]


def test_heartbeats_are_not_request_events():
    router = EventRouter()
    router.open("a", ["d"])
    assert router.deliver(Heartbeat("d", "decode", {}, {})) == 0


def test_losing_a_node_fails_only_the_requests_that_involve_it():
    router = EventRouter()
    q1, q2 = router.open("r1", ["p1", "d1"]), router.open("r2", ["p2", "d1"])
    assert router.node_lost("p1", "no heartbeat") == ["r1"]
    assert drain(q1) == [NodeLost("p1", "no heartbeat")]
    assert drain(q2) == []
    assert sorted(router.node_lost("d1", "gone")) == ["r1", "r2"]


def test_a_forgotten_node_no_longer_fails_the_request():
    router = EventRouter()
    queue = router.open("r1", ["p1", "d1"])
    router.forget_node("r1", "p1")
    assert router.node_lost("p1", "gone") == []
    assert drain(queue) == []


def test_request_ids_must_be_unique_while_in_flight():
    router = EventRouter()
    router.open("a", ["d"])
    with pytest.raises(ValueError, match="already in flight"):
        router.open("a", ["d"])
    router.close("a")
    router.open("a", ["d"])
    assert "a" in router and len(router) == 1
