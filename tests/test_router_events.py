"""Routing node events to per-request queues by request id."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from common.protocol.messages import (
    FirstToken,
    Heartbeat,
    MessageError,
    RequestError,
    TokenBatch,
    TokenOutput,
    decode,
    encode,
)
from router.events import EventRouter, NodeLost


def batch(*rows: tuple[str, int, str | None]) -> TokenBatch:
    """A TokenBatch of (request id, token, finish reason) rows."""
    return TokenBatch([r for r, _, _ in rows], [t for _, t, _ in rows], [f for _, _, f in rows])


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
    tokens = batch(("a", 1, None), ("b", 3, "stop"), ("a", 2, None), ("x", 4, None))
    assert router.deliver(tokens) == 3
    assert [o.token_ids for o in drain(qa)] == [[1], [2]]
    (b_out,) = drain(qb)
    assert isinstance(b_out, TokenOutput) and b_out.finished


def test_events_for_unknown_or_closed_requests_are_dropped():
    router = EventRouter()
    queue = router.open("a", ["d"])
    router.close("a")
    assert router.deliver(batch(("a", 1, None))) == 0
    assert router.deliver(RequestError("never-seen", "x", 500)) == 0
    assert drain(queue) == []


def test_a_malformed_token_batch_is_refused_whole_on_receipt():
    frame = encode(batch(("a", 5, None)))
    raw = msgpack.unpackb(frame)
    for field, value in [
        ("token_ids", b"\x01\x02\x03"),  # not a whole number of int32s
        ("token_ids", [5]),  # a list, not the int32 bytes
        ("finish_reasons", ["tired"]),
        ("request_ids", ["a", "b"]),  # columns of different lengths
        ("request_ids", [7]),
    ]:
        with pytest.raises(MessageError):
            decode(msgpack.packb({**raw, field: value}, use_bin_type=True))


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
