"""Responses as OpenAI's own OpenAPI document defines them: chat completions, every chunk of a
streamed chat, text completions (whole and streamed) and error bodies, validated with
`jsonschema` against the response schemas of openai/openai-openapi kept in
tests/data/openai_openapi. The requests go through the real router to real prefill and decode
nodes on the embedded model: plain, logprobs, n > 1, tools and structured output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from benchmarks.stack import same_python_env
from tests.pd_stack import PDStack

SCHEMAS = json.loads((Path(__file__).parent / "data/openai_openapi/responses.json").read_text())[
    "schemas"
]
ASK = [{"role": "user", "content": "Name a colour."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
COLOUR = {
    "type": "json_schema",
    "json_schema": {
        "name": "colour",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"colour": {"enum": ["red", "green", "blue"]}},
            "required": ["colour"],
        },
    },
}
CHAT_CASES = {
    "plain": {},
    "logprobs": {"logprobs": True, "top_logprobs": 2},
    "n_2": {"n": 2, "temperature": 0.8, "seed": 1},
    "tools": {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 80},
    "tools_auto": {"tools": [WEATHER]},
    "structured": {"response_format": COLOUR},
}
COMPLETION_CASES = {
    "plain": {},
    "logprobs": {"logprobs": 2},
    "logprobs_0": {"logprobs": 0},
    "n_2": {"n": 2, "temperature": 0.8, "seed": 1},
    "structured": {"response_format": COLOUR},
}


def validate(body: dict[str, Any], schema: str) -> None:
    jsonschema.Draft202012Validator(SCHEMAS[schema]).validate(body)


def test_the_schemas_refuse_a_message_without_refusal_and_a_null_stream_finish_reason_passes():
    message = {"role": "assistant", "content": "hi"}
    body = {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}]}  # fmt: skip
    with pytest.raises(jsonschema.ValidationError, match="'refusal' is a required property"):
        validate(body, "CreateChatCompletionResponse")
    validate({**body, "choices": [{**body["choices"][0], "message": {**message, "refusal": None}}]},
             "CreateChatCompletionResponse")  # fmt: skip
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "h"}, "finish_reason": None}]}  # fmt: skip
    validate(chunk, "CreateChatCompletionStreamResponse")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec")
    env = same_python_env(tmp / "venv")
    stack = PDStack("--kv-cache-memory-bytes", str(64 << 20), log_path=tmp / "launch.log", env=env)
    with httpx.Client(base_url=stack.url, timeout=300) as client:
        yield client
    assert stack.stop() == [], "processes left after Ctrl-C"


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": ASK, "max_tokens": 24, "temperature": 0, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "The colours of the rainbow are", "max_tokens": 8, "temperature": 0, **fields}


def events(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON payloads of an SSE response, which must end with [DONE]."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.mark.parametrize("case", sorted(CHAT_CASES))
def test_a_chat_completion_is_an_openai_chat_completion(stack, case):
    response = stack.post("/v1/chat/completions", json=chat(**CHAT_CASES[case]))
    assert response.status_code == 200, response.text
    body = response.json()
    validate(body, "CreateChatCompletionResponse")
    assert len(body["choices"]) == CHAT_CASES[case].get("n", 1)
    if case == "tools":
        assert body["choices"][0]["message"]["tool_calls"]


@pytest.mark.parametrize("case", sorted(CHAT_CASES))
def test_every_chunk_of_a_streamed_chat_is_an_openai_chat_chunk(stack, case):
    chunks = events(stack, "/v1/chat/completions", chat(**CHAT_CASES[case]))
    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse")
    reasons = [c["finish_reason"] for chunk in chunks for c in chunk["choices"]]
    finished = [r for r in reasons if r is not None]
    assert None in reasons and len(finished) == CHAT_CASES[case].get("n", 1)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("case", sorted(COMPLETION_CASES))
def test_a_text_completion_is_an_openai_completion(stack, case):
    response = stack.post("/v1/completions", json=completion(**COMPLETION_CASES[case]))
    assert response.status_code == 200, response.text
    body = response.json()
    validate(body, "CreateCompletionResponse")
    assert len(body["choices"]) == COMPLETION_CASES[case].get("n", 1)


@pytest.mark.parametrize("case", sorted(COMPLETION_CASES))
def test_every_chunk_of_a_streamed_completion_is_an_openai_completion_chunk(stack, case):
    chunks = events(stack, "/v1/completions", completion(**COMPLETION_CASES[case]))
    for chunk in chunks:
        validate(chunk, "CompletionStreamChunk")
    assert chunks[-1]["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/v1/chat/completions", {"messages": []}, 400),
        ("/v1/completions", {"prompt": "a", "model": "no-such-model"}, 404),
        ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400),
    ],
)
def test_an_error_is_an_openai_error_response(stack, path, body, status):
    response = stack.post(path, json=body)
    assert response.status_code == status
    validate(response.json(), "ErrorResponse")
