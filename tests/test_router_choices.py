"""n > 1 in the router: several choices in one response or stream, usage summed over them, and
a choice that ends early (stop string) stops only its own sample on the decode node."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from common.protocol.messages import Abort, DecodeRequest, FirstToken, PrefillRequest, TokenBatch
from router.app import create_app
from router.config import RouterConfig
from tests.router_fakes import LoopbackNodes, ManualClock, heartbeat, metric
from tests.test_router_api_errors import CHAT, HI, TEXT, call
from tests.test_router_api_generation import client, drained, sse_events, until

C = "tcp://127.0.0.1:5801"
P, D = "tcp://127.0.0.1:5601", "tcp://127.0.0.1:5701"
STEP = 0.25  # seconds between decode steps; a power of two, so clock differences are exact


def colocated_app(source, tokenizer, answers: dict[int, str]):
    """A colocated node that answers sample i with answers[i], one token per event."""

    def script(node_id, message):
        if not isinstance(message, DecodeRequest):
            return []
        events = []
        for index, text in answers.items():
            ids = tokenizer.encode(text, add_special_tokens=False)
            for k, token in enumerate(ids):
                reason = "stop" if k == len(ids) - 1 else None
                batch = TokenBatch([message.request_id], [token], [reason], indices=[index])
                events.append(batch)
        return events

    link = LoopbackNodes(script)
    app = create_app(
        RouterConfig(decode=(C,)),
        source=source,
        tokenizer=tokenizer,
        link=link,
        clock=ManualClock(),
    )
    link.deliver = app.state.core.on_message
    app.state.core.on_message(heartbeat(C, "colocated"))
    return app, link


ANSWERS = {0: " red apple", 1: " green pear. More", 2: " blue plum"}


def test_n_choices_come_back_whole_with_usage_over_all_of_them(source, tokenizer):
    app, link = colocated_app(source, tokenizer, ANSWERS)
    body = call(app, "POST", CHAT, {"messages": HI, "n": 3, "max_tokens": 10}).json()
    texts = {c["index"]: c["message"]["content"] for c in body["choices"]}
    assert texts == {i: t for i, t in ANSWERS.items()}
    tokens = sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in ANSWERS.values())
    assert body["usage"]["completion_tokens"] == tokens
    assert link.sent_of(DecodeRequest)[0][1].sampling.n == 3


def test_a_choice_cut_by_a_stop_string_stops_only_its_sample(source, tokenizer):
    app, link = colocated_app(source, tokenizer, ANSWERS)
    response = call(app, "POST", TEXT, {"prompt": "a", "n": 3, "max_tokens": 10, "stop": "."})
    texts = {c["index"]: c["text"] for c in response.json()["choices"]}
    assert texts[1] == " green pear" and texts[0] == " red apple"
    aborts = [m for _, m in link.sent_of(Abort)]
    assert Abort(aborts[0].request_id, 1) in aborts


def test_n_choices_stream_with_their_indices(source, tokenizer):
    app, _ = colocated_app(source, tokenizer, ANSWERS)
    events = sse_events(call(app, "POST", CHAT, {"messages": HI, "n": 3, "stream": True}))[:-1]
    texts: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (
                choice["delta"].get("content") or ""
            )
    assert texts == ANSWERS
    finals = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert sorted(finals) == [0, 1, 2]


def test_sample_indices_travel_in_token_batches_and_aborts():
    from common.protocol.messages import MessageError, decode, encode

    batch = decode(encode(TokenBatch(["r", "r"], [5, 6], [None, "stop"], indices=[0, 2])))
    assert [(o.index, o.finished) for o in batch.items()] == [(0, False), (2, True)]
    assert decode(encode(Abort("r", 1))) == Abort("r", 1)
    with pytest.raises(MessageError, match="differ in length"):
        TokenBatch(["r"], [5], [None], indices=[0, 1])


def pd_app(source, tokenizer):
    """PD nodes that answer nothing on their own: the test delivers every event itself."""
    link = LoopbackNodes()
    config = RouterConfig(prefill=(P,), decode=(D,))
    clock = ManualClock()
    app = create_app(config, source=source, tokenizer=tokenizer, link=link, clock=clock)
    for node, role in [(P, "prefill"), (D, "decode")]:
        app.state.core.on_message(heartbeat(node, role))
    return app, link


def step(rid: str, tokens: list[int], finished: bool = False) -> TokenBatch:
    """One decode step of an n = len(tokens) request: a row per sample."""
    reasons = ["length" if finished else None] * len(tokens)
    return TokenBatch([rid] * len(tokens), tokens, reasons, indices=list(range(len(tokens))))


def run_pd(app, link, body: dict[str, Any], events: list[Any]) -> httpx.Response:
    """POST `body`; deliver the FirstToken and then `events`, STEP seconds apart, each one
    read by the session before the clock moves on."""
    core = app.state.core

    async def scenario() -> httpx.Response:
        async with client(app) as c:
            task = asyncio.create_task(c.post(TEXT, json=body))
            await until(lambda: bool(link.sent_of(PrefillRequest)))
            rid = link.sent_of(PrefillRequest)[0][1].request_id
            for event in events:
                core.on_message(event(rid))
                await until(lambda: drained(core))
                core.clock.now += STEP
            return await task

    return asyncio.run(scenario())


def first_token(token: int):
    return lambda rid: FirstToken(rid, token, None, None, False, None, 0, {})


def test_inter_token_gaps_are_measured_within_each_choice(source, tokenizer):
    app, link = pd_app(source, tokenizer)
    events = [first_token(5), lambda r: step(r, [6, 7]), lambda r: step(r, [8, 9], True)]
    response = run_pd(app, link, {"prompt": [1, 2], "n": 2, "max_tokens": 8}, events)
    assert response.status_code == 200, response.text
    # Choice 0: first token, step 1, step 2; choice 1: step 1, step 2. Every gap is one step.
    assert response.json()["timing"]["decode_intervals"] == {
        "count": 3,
        "mean": STEP,
        "p50": STEP,
        "p99": STEP,
        "max": STEP,
    }
    text = app.state.core.metrics.render()
    assert metric(text, "pdserve:inter_token_latency_seconds_count") == 3
    assert metric(text, "pdserve:inter_token_latency_seconds_sum") == 3 * STEP


def test_a_choice_the_first_token_ended_is_aborted_on_the_decode_node_once(source, tokenizer):
    app, link = pd_app(source, tokenizer)
    (b,) = tokenizer.encode("b", add_special_tokens=False)
    events = [
        first_token(b),  # sample 0 hits the stop string before the decode node has it
        lambda r: step(r, [6, 7]),  # ... which goes on with it
        lambda r: step(r, [8, 9]),
        lambda r: step(r, [10, 11], True),
    ]
    response = run_pd(app, link, {"prompt": [1, 2], "n": 2, "stop": "b"}, events)
    assert response.status_code == 200, response.text
    choices = {c["index"]: c for c in response.json()["choices"]}
    assert (choices[0]["text"], choices[0]["finish_reason"]) == ("", "stop")
    rid = response.json()["id"]
    sample_aborts = [(node, m) for node, m in link.sent_of(Abort) if m.index is not None]
    assert sample_aborts == [(D, Abort(rid, 0))]
