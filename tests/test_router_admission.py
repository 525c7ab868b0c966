"""Admission control through the real FastAPI app against loopback nodes: a bounded number of
requests waiting per pool, 429 with Retry-After past it, and the deadline sent to the nodes."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from common.protocol.messages import DecodeRequest, FirstToken, PrefillRequest, TokenBatch
from router.admission import Admission
from router.app import create_app
from router.config import RouterConfig
from tests.router_fakes import LoopbackNodes, ManualClock, heartbeat

P, D = "tcp://127.0.0.1:5601", "tcp://127.0.0.1:5701"


def build(source, tokenizer, **cfg):
    link = LoopbackNodes()  # nodes that never answer: every request stays waiting
    config = RouterConfig(prefill=(P,), decode=(D,), served_model_name="smol", **cfg)
    app = create_app(config, source=source, tokenizer=tokenizer, link=link, clock=ManualClock())
    core = app.state.core
    link.deliver = core.on_message
    core.on_message(heartbeat(P, "prefill"))
    core.on_message(heartbeat(D, "decode"))
    return app, core, link


def first_token(rid: str) -> FirstToken:
    return FirstToken(rid, 7, None, None, False, None, 0, {})


def decode_token(rid: str, finished: bool) -> TokenBatch:
    return TokenBatch([rid], [8], ["length" if finished else None])


async def start(client: httpx.AsyncClient, n: int) -> list[asyncio.Task[httpx.Response]]:
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    tasks = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(n)]
    await settle()
    return tasks


async def settle() -> None:
    """Let the app's tasks run until they wait on the nodes again."""
    for _ in range(50):
        await asyncio.sleep(0)


def test_past_the_waiting_bound_requests_get_429_with_retry_after(source, tokenizer):
    app, core, link = build(source, tokenizer, max_waiting_requests=2, retry_after_s=3)

    async def scenario() -> tuple[list[httpx.Response], list[Any]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
            admitted = await start(client, 2)
            refused = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
            # Admitted requests are not disturbed: they finish normally.
            for _, req in link.sent_of(PrefillRequest):
                core.on_message(first_token(req.request_id))
                core.on_message(decode_token(req.request_id, finished=True))
            return [refused, *[await t for t in admitted]], link.sent_of(DecodeRequest)

    (refused, *done), dispatched = asyncio.run(scenario())
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "3"
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and "prefill pool" in error["message"]
    assert [r.status_code for r in done] == [200, 200]
    assert len(dispatched) == 2  # the refused request never reached a node
    assert core.admission.waiting("prefill") == core.admission.waiting("decode") == 0


def test_a_request_past_its_prefill_waits_for_the_decode_pool(source, tokenizer):
    app, core, link = build(source, tokenizer, max_waiting_requests=1)

    async def scenario() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
            (first,) = await start(client, 1)
            rid = link.sent_of(PrefillRequest)[0][1].request_id
            core.on_message(first_token(rid))  # prefill done: now waiting for the decode pool
            await settle()
            assert (core.admission.waiting("prefill"), core.admission.waiting("decode")) == (0, 1)
            refused = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
            core.on_message(decode_token(rid, finished=False))  # decoding: no longer waiting
            await settle()
            (second,) = await start(client, 1)
            assert core.admission.waiting("prefill") == 1
            core.on_message(decode_token(rid, finished=True))
            statuses = [refused.status_code, (await first).status_code]
            second.cancel()
            return statuses

    assert asyncio.run(scenario()) == [429, 200]


def test_no_bound_when_max_waiting_is_zero():
    admission = Admission(max_waiting=0, retry_after_s=1)
    for i in range(10_000):
        admission.check(pd=True)
        admission.admitted(f"r{i}", pd=True)
    assert admission.waiting("prefill") == 10_000


def test_nodes_get_the_time_left_before_the_router_deadline(source, tokenizer):
    app, core, link = build(source, tokenizer, request_timeout_s=30)

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://r") as client:
            (task,) = await start(client, 1)
            task.cancel()

    asyncio.run(scenario())
    [(_, decode)], [(_, prefill)] = link.sent_of(DecodeRequest), link.sent_of(PrefillRequest)
    assert decode.deadline_s == prefill.deadline_s == 30.0  # the manual clock did not move
