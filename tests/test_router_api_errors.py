"""OpenAI request validation and error shapes through the real FastAPI app (loopback nodes)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from router.app import create_app
from router.config import RouterConfig
from tests.router_fakes import LoopbackNodes, ManualClock, generation_script, heartbeat, metric

P, D = "tcp://127.0.0.1:5601", "tcp://127.0.0.1:5701"
MODEL = "smol"


@pytest.fixture
def app(source, tokenizer):
    link = LoopbackNodes(generation_script([28120, 905]))
    config = RouterConfig(prefill=(P,), decode=(D,), served_model_name=MODEL)
    app = create_app(config, source=source, tokenizer=tokenizer, link=link, clock=ManualClock())
    link.deliver = app.state.core.on_message
    return app


def beat(app, max_model_len: int = 64, vocab_size: int = 49152) -> None:
    for node, role in [(P, "prefill"), (D, "decode")]:
        hb = heartbeat(node, role, max_model_len=max_model_len, vocab_size=vocab_size)
        app.state.core.on_message(hb)


def call(app, method: str, path: str, body: Any = None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            content = body if isinstance(body, (str, bytes)) or body is None else json.dumps(body)
            return await client.request(method, path, content=content)

    return asyncio.run(go())


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    return error["message"]


CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]

BAD_REQUESTS = [
    ("malformed_json", TEXT, '{"prompt": "a",', None),
    ("not_an_object", TEXT, "[1, 2]", None),
    ("missing_prompt", TEXT, {"max_tokens": 3}, "prompt"),
    ("string_temperature", TEXT, {"prompt": "a", "temperature": "hot"}, "temperature"),
    ("bool_max_tokens", TEXT, {"prompt": "a", "max_tokens": True}, "max_tokens"),
    ("float_max_tokens", TEXT, {"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
    ("empty_messages", CHAT, {"messages": []}, "messages"),
    ("empty_messages_to_continue", CHAT, {"messages": [], "continue_final_message": True}, "messages"),
    ("messages_not_a_list", CHAT, {"messages": "hi"}, "messages"),
    ("unknown_role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("image_part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("n_zero", CHAT, {"messages": HI, "n": 0}, "n"),
    ("negative_max_tokens", TEXT, {"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ("absurd_max_tokens", TEXT, {"prompt": "a", "max_tokens": 10**12}, "max_tokens"),
    ("absurd_max_completion_tokens", CHAT, {"messages": HI, "max_completion_tokens": 10**12}, "max_completion_tokens"),
    ("prompt_plus_max_tokens_too_long", TEXT, {"prompt": [1] * 40, "max_tokens": 30}, "max_tokens"),
    ("prompt_fills_context", TEXT, {"prompt": [1] * 64}, "prompt"),
    ("chat_prompt_too_long", CHAT, {"messages": [{"role": "user", "content": "hi " * 200}]}, "messages"),
    ("token_id_above_vocab", TEXT, {"prompt": [1, 49152]}, "prompt"),
    ("negative_token_id", TEXT, {"prompt": [1, -3]}, "prompt"),
    ("several_prompts", TEXT, {"prompt": ["a", "b"]}, "prompt"),
    ("empty_prompt", TEXT, {"prompt": ""}, "prompt"),
    ("top_p_zero", TEXT, {"prompt": "a", "top_p": 0.0}, "top_p"),
    ("temperature_negative", TEXT, {"prompt": "a", "temperature": -1.0}, "temperature"),
    ("empty_stop_string", TEXT, {"prompt": "a", "stop": [""]}, "stop"),
    ("completion_logprobs_too_many", TEXT, {"prompt": "a", "logprobs": 50}, "logprobs"),
    ("top_logprobs_without_logprobs", CHAT, {"messages": HI, "top_logprobs": 2}, "top_logprobs"),
    ("top_logprobs_too_many", CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("min_tokens_above_max_tokens", TEXT, {"prompt": "a", "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
    ("min_tokens_above_the_default_max_tokens", TEXT, {"prompt": [1, 2, 3], "min_tokens": 62}, "min_tokens"),
    ("min_tokens_beyond_64_bits", TEXT, {"prompt": [1, 2, 3], "min_tokens": 2**64}, "min_tokens"),
    ("top_k_beyond_64_bits", TEXT, {"prompt": [1, 2, 3], "top_k": 2**64}, "top_k"),
    ("top_k_beyond_int32", TEXT, {"prompt": [1, 2, 3], "top_k": 2**40}, "top_k"),
    ("repetition_penalty_nan", TEXT, {"prompt": "a", "repetition_penalty": float("nan")}, "repetition_penalty"),
    ("repetition_penalty_infinite", TEXT, {"prompt": "a", "repetition_penalty": float("inf")}, "repetition_penalty"),
    ("temperature_infinite", TEXT, {"prompt": "a", "temperature": float("inf")}, "temperature"),
    ("seed_beyond_64_bits", TEXT, {"prompt": "a", "seed": 2**70}, "seed"),
    ("stop_token_outside_vocab", TEXT, {"prompt": "a", "stop_token_ids": [10**6]}, "stop_token_ids"),
]  # fmt: skip


@pytest.mark.parametrize(
    "path,body,param", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS]
)
def test_invalid_requests_are_openai_400s(app, path, body, param):
    beat(app)
    assert_openai_error(call(app, "POST", path, body), 400, param)
    assert app.state.core.link.sent == []  # nothing reached a node


def test_an_integer_too_large_for_the_wire_is_a_400_that_leaves_no_request_open(app):
    # The loopback link encodes every message as the sockets do: 2**64 does not fit msgpack.
    beat(app)
    message = assert_openai_error(
        call(app, "POST", TEXT, {"prompt": [1, 2, 3], "top_k": 2**64}), 400, "top_k"
    )
    assert str(2**64) in message
    assert len(app.state.core.events) == 0


def test_over_long_prompt_message_names_the_context_length(app):
    beat(app)
    message = assert_openai_error(
        call(app, "POST", TEXT, {"prompt": [1] * 40, "max_tokens": 30}), 400
    )
    assert "64" in message and "70" in message


def test_unknown_model_is_404(app):
    beat(app)
    response = call(app, "POST", CHAT, {"model": "gpt-9", "messages": HI})
    assert_openai_error(response, 404, "model")
    assert response.json()["error"]["code"] == "model_not_found"


def test_the_served_name_and_the_model_directory_name_are_both_accepted(app):
    beat(app)
    for name in (MODEL, "SmolLM2-135M-Instruct", None):
        body = {"prompt": "a", "max_tokens": 2} | ({"model": name} if name else {})
        assert call(app, "POST", TEXT, body).status_code == 200


def test_no_heartbeat_yet_is_503(app):
    message = assert_openai_error(call(app, "POST", TEXT, {"prompt": "a"}), 503)
    assert "prefill" in message


def test_a_prefill_node_without_a_decode_node_is_503(app):
    app.state.core.on_message(heartbeat(P, "prefill"))
    message = assert_openai_error(call(app, "POST", TEXT, {"prompt": "a"}), 503)
    assert "decode" in message


def test_nodes_that_went_silent_are_503(app):
    beat(app)
    app.state.core.clock.now += 3.5
    assert_openai_error(call(app, "POST", TEXT, {"prompt": "a"}), 503)


def test_unknown_path_and_wrong_method_are_openai_errors(app):
    assert_openai_error(call(app, "GET", "/v1/nothing"), 404)
    assert_openai_error(call(app, "GET", CHAT), 405)


def test_unexpected_failure_is_an_openai_500_and_the_server_goes_on(app, source):
    class BrokenTokenizer:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            raise RuntimeError("tokenizer exploded")

    link = LoopbackNodes()
    config = RouterConfig(prefill=(P,), decode=(D,))
    broken = create_app(config, source=source, tokenizer=BrokenTokenizer(), link=link)
    beat(broken)
    assert_openai_error(call(broken, "POST", TEXT, {"prompt": "a"}), 500)
    assert call(broken, "GET", "/health").status_code == 200


def test_errors_are_counted_by_status(app):
    call(app, "POST", TEXT, {"prompt": "a"})  # 503: no nodes yet
    beat(app)
    call(app, "POST", TEXT, "{")
    call(app, "POST", TEXT, {"prompt": "a", "model": "x"})
    text = call(app, "GET", "/metrics").text
    for status in ("400", "404", "503"):
        assert metric(text, "pdserve:requests_total", status=status) == 1
