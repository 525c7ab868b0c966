"""Generation through the real FastAPI app against loopback nodes: bodies, SSE, stop strings,
aborts, node failures, timeouts and client disconnects."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from common.protocol.messages import (
    Abort,
    DecodeRequest,
    FirstToken,
    PrefillRequest,
    RequestError,
    TokenBatch,
)
from router.app import create_app
from router.config import RouterConfig
from tests.router_fakes import (
    LoopbackNodes,
    ManualClock,
    Script,
    generation_script,
    heartbeat,
    metric,
)

P, D, C = "tcp://127.0.0.1:5601", "tcp://127.0.0.1:5701", "tcp://127.0.0.1:5801"
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
ANSWER = " Hello world, this is a test."


@pytest.fixture(scope="module")
def answer_ids(tokenizer) -> list[int]:
    return tokenizer.encode(ANSWER, add_special_tokens=False)


@pytest.fixture
def make(source, tokenizer):
    def build(script: Script | None, *, colocated: bool = False, max_model_len: int = 2048, **cfg):
        link = LoopbackNodes(script)
        if colocated:
            config = RouterConfig(decode=(C,), served_model_name="smol", **cfg)
        else:
            config = RouterConfig(prefill=(P,), decode=(D,), served_model_name="smol", **cfg)
        app = create_app(config, source=source, tokenizer=tokenizer, link=link, clock=ManualClock())
        core = app.state.core
        link.deliver = core.on_message
        nodes = [(C, "colocated")] if colocated else [(P, "prefill"), (D, "decode")]
        for node, role in nodes:
            core.on_message(heartbeat(node, role, max_model_len=max_model_len))
        return app, core, link

    return build


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


def post(app, path: str, body: dict[str, Any]) -> httpx.Response:
    async def go() -> httpx.Response:
        async with client(app) as c:
            return await c.post(path, json=body)

    return asyncio.run(go())


def sse_events(response: httpx.Response) -> list[Any]:
    """The data payloads of an SSE body, checking the `data: ...\\n\\n` framing."""
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-1] == ""
    out = []
    for block in blocks[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_chat_completion_returns_text_usage_and_timing(make, answer_ids):
    timing = {"prefill_queue": 0.01, "prefill_compute": 0.02}
    script = generation_script(
        answer_ids, prefill_timing=timing, decode_timing={"kv_transfer": 0.003}
    )
    app, core, link = make(script)
    body = post(app, CHAT, {"model": "smol", "messages": HI, "max_tokens": 50}).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "smol"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": ANSWER, "refusal": None}
    assert choice["finish_reason"] == "stop"
    prompt_len = len(link.sent_of(DecodeRequest)[0][1].prompt_token_ids)
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": len(answer_ids),
        "total_tokens": prompt_len + len(answer_ids),
    }
    t = body["timing"]
    assert (t["prefill_queue"], t["prefill_compute"], t["kv_transfer"]) == (0.01, 0.02, 0.003)
    assert t["decode_intervals"]["count"] == len(answer_ids) - 1
    assert {"router_queue_tokenize", "first_token_delivery", "ttft", "e2e"} <= set(t)
    assert len(core.events) == 0 and link.sent_of(Abort) == []


def test_pd_dispatch_sends_decode_then_prefill_request_with_sampling_fields(make, answer_ids):
    app, _, link = make(generation_script(answer_ids))
    request = {
        "prompt": [5, 6, 7],
        "max_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 1234,
        "stop": "zz",
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "min_tokens": 2,
        "stop_token_ids": [7],
    }
    post(app, TEXT, request)
    (d_node, decode), (p_node, prefill) = link.sent[:2]
    assert (d_node, p_node) == (D, P)
    assert isinstance(decode, DecodeRequest) and decode.prefill_node == P
    assert isinstance(prefill, PrefillRequest)
    assert (prefill.decode_node, prefill.decode_kv_address) == (D, f"{D}/kv")
    assert decode.prompt_token_ids.tolist() == prefill.prompt_token_ids.tolist() == [5, 6, 7]
    expected = {k: v for k, v in request.items() if k != "prompt"} | {"stop": ["zz"]}
    assert {k: getattr(prefill.sampling, k) for k in expected} == expected
    assert prefill.sampling == decode.sampling


def test_default_max_tokens_is_the_remaining_context(make, answer_ids):
    app, _, link = make(generation_script(answer_ids), max_model_len=100)
    post(app, TEXT, {"prompt": list(range(1, 11))})
    assert link.sent_of(DecodeRequest)[0][1].sampling.max_tokens == 90


def test_completion_accepts_token_ids_and_one_element_prompt_lists(make, answer_ids):
    app, _, link = make(generation_script(answer_ids))
    for prompt in ([11, 12], [[11, 12]], ["hello"]):
        body = post(app, TEXT, {"prompt": prompt, "max_tokens": 3}).json()
        assert (
            body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
        )
        assert body["usage"]["completion_tokens"] == 3
    sent = [m.prompt_token_ids.tolist() for _, m in link.sent_of(PrefillRequest)]
    assert sent[0] == sent[1] == [11, 12]


def test_streaming_chat_sends_role_first_finish_with_timing_then_done(make, answer_ids):
    app, _, _ = make(generation_script(answer_ids))
    events = sse_events(post(app, CHAT, {"messages": HI, "stream": True}))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == ANSWER
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "timing" in chunks[-1] and all("timing" not in c for c in chunks[:-1])
    assert all("usage" not in c for c in chunks)


def test_stream_include_usage_adds_a_usage_chunk_before_done(make, answer_ids):
    app, _, _ = make(generation_script(answer_ids))
    request = {
        "prompt": "x",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = sse_events(post(app, TEXT, request))
    *chunks, usage, done = events
    assert done == "[DONE]"
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert usage["timing"]["e2e"] == chunks[-1]["timing"]["e2e"]


def test_stop_string_ends_the_request_and_aborts_both_nodes(make, answer_ids, tokenizer):
    app, core, link = make(generation_script(answer_ids))
    body = post(app, TEXT, {"prompt": "x", "stop": [" world", "never"]}).json()
    assert body["choices"][0]["text"] == " Hello"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 2  # " Hello", " world"
    rid = body["id"]
    assert link.sent_of(Abort) == [(P, Abort(rid)), (D, Abort(rid))]
    assert len(core.events) == 0


def test_a_stop_string_ends_a_choice_only_after_min_tokens(make, tokenizer):
    ids = tokenizer.encode(" b b b x", add_special_tokens=False)  # " b" " b" " b" " x"
    app, _, link = make(generation_script(ids))
    body = post(app, TEXT, {"prompt": "x", "stop": "b", "min_tokens": 3}).json()
    assert body["choices"][0]["text"] == " b b b x"
    assert body["usage"]["completion_tokens"] == 4 and link.sent_of(Abort) == []
    body = post(app, TEXT, {"prompt": "x", "stop": "b", "min_tokens": 2}).json()
    assert body["choices"][0]["text"] == " b b "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 3


def test_streamed_stop_string_never_leaks_into_the_text(make, answer_ids):
    app, _, link = make(generation_script(answer_ids))
    events = sse_events(post(app, CHAT, {"messages": HI, "stop": "s a", "stream": True}))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-1])
    assert text == " Hello world, this i" and events[-2]["choices"][0]["finish_reason"] == "stop"
    assert len(link.sent_of(Abort)) == 2


def test_router_enforces_max_tokens_when_a_node_overshoots(make, answer_ids):
    app, _, link = make(generation_script(answer_ids, obey_max_tokens=False))
    body = post(app, TEXT, {"prompt": "x", "max_tokens": 3}).json()
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"
    assert len(link.sent_of(Abort)) == 2


def test_first_token_finishing_the_request_ends_it(make, answer_ids):
    app, _, link = make(generation_script(answer_ids))
    body = post(app, TEXT, {"prompt": "x", "max_tokens": 1}).json()
    assert body["usage"]["completion_tokens"] == 1
    assert body["choices"][0] == {
        "index": 0,
        "text": " Hello",
        "logprobs": None,
        "finish_reason": "length",
    }
    assert link.sent_of(Abort) == []


def test_decode_output_that_overtakes_the_first_token_waits_for_it(make, answer_ids):
    def overtaking(node_id: str, message: Any) -> list[Any]:
        events = generation_script(answer_ids)(node_id, message)
        return events[1:] + events[:1] if events else []

    app, _, _ = make(overtaking)
    assert post(app, TEXT, {"prompt": "x"}).json()["choices"][0]["text"] == ANSWER


def test_colocated_mode_sends_only_a_decode_request_and_reads_node_timing(make, answer_ids):
    timing = {"prefill_queue": 0.5, "prefill_compute": 0.25}
    app, _, link = make(generation_script(answer_ids, prefill_timing=timing), colocated=True)
    body = post(app, TEXT, {"prompt": "x"}).json()
    assert body["choices"][0]["text"] == ANSWER
    assert [type(m) for _, m in link.sent] == [DecodeRequest]
    assert link.sent[0][1].prefill_node is None
    assert (body["timing"]["prefill_queue"], body["timing"]["prefill_compute"]) == (0.5, 0.25)
    assert body["timing"]["kv_transfer"] is None


def test_chat_logprobs_are_returned_per_token(make, answer_ids):
    app, _, link = make(generation_script(answer_ids))
    request = {"messages": HI, "max_tokens": 3, "logprobs": True, "top_logprobs": 1}
    body = post(app, CHAT, request).json()
    assert link.sent_of(PrefillRequest)[0][1].sampling.logprobs == 1
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [" Hello", " world", ","]
    assert all(
        e["logprob"] == -0.5 and e["top_logprobs"][0]["token"] == e["token"] for e in content
    )


def test_completion_logprobs_in_a_stream(make, answer_ids):
    app, _, _ = make(generation_script(answer_ids))
    events = sse_events(
        post(app, TEXT, {"prompt": "x", "max_tokens": 2, "logprobs": 0, "stream": True})
    )
    lps = [c["choices"][0]["logprobs"] for c in events[:-1]]
    assert sum((lp["tokens"] for lp in lps), []) == [" Hello", " world"]
    assert sum((lp["text_offset"] for lp in lps), []) == [0, 6]


def test_events_queued_while_the_client_is_served_become_one_chunk(make, answer_ids):
    # The loopback nodes answer during dispatch, so every event is queued before the stream's
    # first read: a router that fell behind catches up with one chunk, losing no token.
    app, _, _ = make(generation_script(answer_ids))
    request = {"prompt": "x", "max_tokens": 50, "logprobs": 0, "stream": True}
    *chunks, done = sse_events(post(app, TEXT, request))
    assert done == "[DONE]"
    (chunk,) = chunks
    (choice,) = chunk["choices"]
    assert choice["text"] == ANSWER and choice["finish_reason"] == "stop"
    assert len(choice["logprobs"]["tokens"]) == len(answer_ids)


def test_node_error_becomes_an_openai_error_with_its_status(make):
    def refuse(node_id: str, message: Any) -> list[Any]:
        if isinstance(message, PrefillRequest):
            return [RequestError(message.request_id, "no KV blocks for this prompt", 400)]
        return []

    app, core, link = make(refuse)
    response = post(app, TEXT, {"prompt": "x"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "no KV blocks for this prompt"
    assert {node for node, _ in link.sent_of(Abort)} == {P, D}
    assert len(core.events) == 0


def first_token_only(node_id: str, message: Any) -> list[Any]:
    if isinstance(message, PrefillRequest):
        return [FirstToken(message.request_id, 28120, None, None, False, None, 0, {})]
    return []


async def until(condition, limit: int = 1000) -> None:
    for _ in range(limit):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


def test_decode_node_death_fails_an_in_flight_request_with_503(make):
    app, core, link = make(first_token_only)

    async def scenario() -> httpx.Response:
        async with client(app) as c:
            task = asyncio.create_task(c.post(TEXT, json={"prompt": "x"}))
            await until(lambda: len(core.events) == 1 and link.sent_of(PrefillRequest))
            core.clock.now += 2.0
            core.on_message(heartbeat(P, "prefill"))  # the prefill node stays alive
            core.clock.now += 1.5
            assert core.sweep() == [D]
            return await task

    response = asyncio.run(scenario())
    assert response.status_code == 503
    assert D in response.json()["error"]["message"]
    assert len(core.events) == 0


def test_streaming_request_ends_with_an_error_event_when_a_node_dies(make):
    app, core, _ = make(first_token_only)

    async def scenario() -> httpx.Response:
        async with client(app) as c:
            task = asyncio.create_task(c.post(TEXT, json={"prompt": "x", "stream": True}))
            # Open, and the first token delivered (it no longer counts as queued prefill work).
            await until(lambda: len(core.events) == 1 and core.ledger.prefill_tokens(P) == 0)
            core.clock.now += 5.0
            core.sweep()
            return await task

    events = sse_events(asyncio.run(scenario()))
    assert events[0]["choices"][0]["text"] == "hello"
    assert set(events[-1]) == {"error"} and "[DONE]" not in events
    assert metric(core.metrics.render(), "pdserve:requests_total", status="503") == 1


def test_losing_the_prefill_node_after_decode_took_over_is_harmless(make, answer_ids):
    events_by_request: dict[str, list[Any]] = {}

    def held(node_id: str, message: Any) -> list[Any]:
        events = generation_script(answer_ids)(node_id, message)
        if events:
            events_by_request[message.request_id] = events[2:]
            return events[:2]  # first token and the decode node's first output
        return []

    app, core, _ = make(held)

    async def scenario() -> httpx.Response:
        async with client(app) as c:
            task = asyncio.create_task(c.post(TEXT, json={"prompt": "x"}))
            await until(lambda: bool(events_by_request))
            await asyncio.sleep(0)
            core.clock.now += 2.0
            core.on_message(heartbeat(D, "decode"))
            core.clock.now += 1.5
            assert core.sweep() == [P]
            (rest,) = events_by_request.values()
            for event in rest:
                core.on_message(event)
            return await task

    assert asyncio.run(scenario()).json()["choices"][0]["text"] == ANSWER


def held_script(answer_ids: list[int], held: dict[str, list[Any]]) -> Script:
    """Nodes whose events the test delivers itself, in the order it chooses."""

    def script(node_id: str, message: Any) -> list[Any]:
        events = generation_script(answer_ids)(node_id, message)
        if events:
            held[message.request_id] = events
        return []

    return script


def drained(core) -> bool:
    """Every open request's session has read all of its queued events."""
    return all(entry.queue.empty() for entry in core.events._open.values())


def prefill_dies(core) -> None:
    core.clock.now += 2.0
    core.on_message(heartbeat(D, "decode"))
    core.clock.now += 1.5
    assert core.sweep() == [P]


def post_and_play(make, answer_ids, play) -> httpx.Response:
    """POST one completion whose node events the router does not get by itself: the nodes'
    script holds them, and `play(core, events)` (async) hands them over in its own order."""
    held: dict[str, list[Any]] = {}
    app, core, _ = make(held_script(answer_ids, held))

    async def scenario() -> httpx.Response:
        async with client(app) as c:
            task = asyncio.create_task(c.post(TEXT, json={"prompt": "x"}))
            await until(lambda: bool(held))
            (events,) = held.values()
            await play(core, events)
            return await task

    return asyncio.run(scenario())


def test_losing_the_prefill_node_after_an_overtaking_decode_output_is_harmless(make, answer_ids):
    async def play(core, events) -> None:
        first, decoded, *rest = events
        core.on_message(decoded)  # overtakes the first token
        core.on_message(first)
        await until(lambda: drained(core))
        prefill_dies(core)
        for event in rest:
            core.on_message(event)

    response = post_and_play(make, answer_ids, play)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == ANSWER


def test_a_prefill_loss_queued_behind_a_decode_output_is_harmless(make, answer_ids):
    async def play(core, events) -> None:
        first, decoded, *rest = events
        core.on_message(first)
        await until(lambda: drained(core))
        core.on_message(decoded)  # queued: the session has not read it yet ...
        prefill_dies(core)  # ... when the prefill node is declared dead
        for event in rest:
            core.on_message(event)

    response = post_and_play(make, answer_ids, play)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == ANSWER


def test_losing_the_prefill_node_before_its_first_token_fails_the_request(make, answer_ids):
    async def play(core, events) -> None:
        _, decoded, *_ = events
        core.on_message(decoded)  # the first token, the prefill node's, never comes
        await until(lambda: drained(core))
        prefill_dies(core)

    response = post_and_play(make, answer_ids, play)
    assert response.status_code == 503 and P in response.json()["error"]["message"]


def test_request_timeout_is_504_and_aborts_the_nodes(make):
    def stall(node_id: str, message: Any) -> list[Any]:
        app.state.core.clock.now += 601.0  # the nodes take longer than --request-timeout
        return []

    app, core, link = make(stall)
    response = post(app, TEXT, {"prompt": "x"})
    assert response.status_code == 504
    assert {node for node, _ in link.sent_of(Abort)} == {P, D}
    assert len(core.events) == 0


def test_send_failure_is_503_and_leaves_nothing_in_flight(make):
    app, core, link = make(first_token_only)
    link.unreachable.add(P)
    response = post(app, TEXT, {"prompt": "x"})
    assert response.status_code == 503
    assert link.sent_of(Abort) == [(D, Abort(link.sent[0][1].request_id))]
    assert len(core.events) == 0
    assert metric(core.metrics.render(), "pdserve:router_requests_in_flight") == 0


def test_any_failure_while_sending_is_cleaned_up_and_leaves_nothing_in_flight(make):
    def refused_by_the_codec(node_id: str, message: Any) -> list[Any]:
        if isinstance(message, PrefillRequest):
            raise OverflowError("Integer value out of range")  # what msgpack raises
        return []

    app, core, link = make(refused_by_the_codec)
    response = post(app, TEXT, {"prompt": "x"})
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    assert {node for node, _ in link.sent_of(Abort)} == {P, D}
    assert len(core.events) == 0
    assert metric(core.metrics.render(), "pdserve:router_requests_in_flight") == 0


def asgi_scope(path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5000),
        "server": ("router", 80),
    }


def run_until_client_leaves(app, body: dict[str, Any], leave_after_body: bool) -> list[dict]:
    """Drive the ASGI app directly; the client disconnects once the first body bytes arrive
    (streaming) or right after sending the request (non-streaming)."""

    async def scenario() -> list[dict]:
        gone = asyncio.Event()
        if not leave_after_body:
            gone.set()
        requested = False
        sent: list[dict] = []

        async def receive() -> dict:
            nonlocal requested
            if not requested:
                requested = True
                return {
                    "type": "http.request",
                    "body": json.dumps(body).encode(),
                    "more_body": False,
                }
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                gone.set()

        await app(asgi_scope(TEXT), receive, send)
        return sent

    return asyncio.run(scenario())


def test_client_disconnect_during_a_stream_aborts_both_nodes(make):
    app, core, link = make(first_token_only)
    run_until_client_leaves(app, {"prompt": "x", "stream": True}, leave_after_body=True)
    rid = link.sent[0][1].request_id
    assert link.sent_of(Abort) == [(P, Abort(rid)), (D, Abort(rid))]
    assert len(core.events) == 0
    assert metric(core.metrics.render(), "pdserve:requests_total", status="499") == 1


def test_client_disconnect_during_a_non_streaming_request_aborts_both_nodes(make):
    app, core, link = make(first_token_only)
    run_until_client_leaves(app, {"prompt": "x"}, leave_after_body=False)
    assert {node for node, _ in link.sent_of(Abort)} == {P, D}
    assert len(core.events) == 0


def test_events_after_the_end_of_a_request_are_ignored(make, answer_ids):
    app, core, _ = make(generation_script(answer_ids))
    rid = post(app, TEXT, {"prompt": "x", "max_tokens": 2}).json()["id"]
    late = TokenBatch([rid], [1], ["stop"])
    core.on_message(late)
    assert len(core.events) == 0


def test_health_lists_nodes_and_turns_503_when_a_path_is_lost(make):
    app, core, _ = make(None)

    def health() -> httpx.Response:
        async def go() -> httpx.Response:
            async with client(app) as c:
                return await c.get("/health")

        return asyncio.run(go())

    ok = health()
    assert ok.status_code == 200 and ok.json()["status"] == "ok" and ok.json()["mode"] == "pd"
    assert {(n["id"], n["role"], n["healthy"]) for n in ok.json()["nodes"]} == {
        (P, "prefill", True),
        (D, "decode", True),
    }
    assert all({"last_heartbeat_age_s", "load"} <= set(n) for n in ok.json()["nodes"])
    core.clock.now += 2.0
    core.on_message(heartbeat(D, "decode"))
    core.clock.now += 1.5
    down = health()
    assert down.status_code == 503 and down.json()["status"] == "unavailable"
    assert {n["id"]: n["healthy"] for n in down.json()["nodes"]} == {P: False, D: True}


def test_models_lists_the_served_model(make):
    app, _, _ = make(None)

    async def go() -> httpx.Response:
        async with client(app) as c:
            return await c.get("/v1/models")

    body = asyncio.run(go()).json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == "smol" and card["object"] == "model" and card["max_model_len"] == 2048


def test_metrics_count_requests_tokens_and_phases(make, answer_ids):
    timing = {"prefill_queue": 0.01, "prefill_compute": 0.02}
    app, core, _ = make(generation_script(answer_ids, prefill_timing=timing))
    post(app, TEXT, {"prompt": "x", "max_tokens": 3})
    post(app, TEXT, {"prompt": "x", "max_tokens": 3, "stream": True})
    text = core.metrics.render()
    model = {"model_name": "smol"}
    assert metric(text, "pdserve:requests_total", status="200", **model) == 2
    assert metric(text, "pdserve:request_success_total", finished_reason="length") == 2
    assert metric(text, "pdserve:generation_tokens_total", **model) == 6
    assert metric(text, "pdserve:time_to_first_token_seconds_count", **model) == 2
    assert metric(text, "pdserve:inter_token_latency_seconds_count", **model) == 4
    assert metric(text, "pdserve:request_prefill_time_seconds_count", **model) == 2
    assert metric(text, "pdserve:request_phase_seconds_count", phase="prefill_compute") == 2
    assert metric(text, "pdserve:router_requests_in_flight", **model) == 0
    assert metric(text, "pdserve:node_requests_total", node=P, role="prefill") == 2
    assert metric(text, "pdserve:node_requests_total", node=D, role="decode") == 2
