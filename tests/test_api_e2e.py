"""The OpenAI surface end to end through the official `openai` client against launched stacks:
PD with the embedded SmolLM2, and colocated with a tiny random Qwen2-style model that carries a
tool-capable chat template, served by hub id from a temporary Hugging Face cache (offline).

Structured outputs, forced tool calls (whole and streamed), tool results rendered by the
template, n > 1, logit_bias, and refused fields. Grammars make the JSON valid whatever the
model samples, so these checks hold even for random weights.
"""

from __future__ import annotations

import concurrent.futures
import json
import os

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.pd_stack import PDStack
from tests.tiny_models import hub_cache_layout, save_tiny_tool_model

HUB_ID = "tiny-org/tiny-tools"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"enum": ["chess", "music", "hiking"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "zone": {"enum": ["north", "south"]}},
            "required": ["city", "zone"],
        },
    },
    "required": ["name", "age", "hobbies", "address"],
}  # fmt: skip
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}  # fmt: skip
ASK = [{"role": "user", "content": "Describe a fictional person as JSON."}]
COPY_ME = 'Repeat this JSON object exactly: {"city": "Paris", "country": "France"}'
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


SMALL_KV = ("--kv-cache-memory-bytes", str(128 << 20))  # CI machines are shared: 128 MiB per node


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    stack = PDStack(*SMALL_KV, log_path=tmp_path_factory.mktemp("pd") / "launch.log")
    client = OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    yield stack, client, client.models.list().data[0].id
    assert stack.stop() == [], "processes left after Ctrl-C"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    model = save_tiny_tool_model(root / "model")
    hub_cache_layout(root / "hf" / "hub", HUB_ID, model)
    env = dict(os.environ, HF_HOME=str(root / "hf"), HF_HUB_OFFLINE="1")
    stack = PDStack(HUB_ID, "--colocated", log_path=root / "launch.log", env=env)
    client = OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    yield stack, client, AutoTokenizer.from_pretrained(model)
    assert stack.stop() == [], "processes left after Ctrl-C"


def many_json_schema_requests(client, model: str, count: int) -> list:
    def one(seed: int):
        return client.chat.completions.create(
            model=model, messages=ASK, temperature=0.7, seed=seed, max_tokens=160,
            response_format=schema_format(PERSON),
        )  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(count) as pool:  # one decode batch
        return list(pool.map(one, range(count)))


def test_pd_20_json_schema_requests_at_temperature_all_validate(pd):
    _, client, model = pd
    for response in many_json_schema_requests(client, model, 20):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_colocated_json_schema_requests_validate_and_the_model_came_from_the_hub_cache(tiny):
    _, client, _ = tiny
    assert client.models.list().data[0].id == HUB_ID
    for response in many_json_schema_requests(client, HUB_ID, 8):
        jsonschema.validate(json.loads(response.choices[0].message.content), PERSON)


def test_pd_json_object_output_parses(pd):
    _, client, model = pd
    response = client.chat.completions.create(
        model=model, temperature=0, max_tokens=60, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": COPY_ME}],
    )  # fmt: skip
    # A 135M model rambles on open questions until max_tokens; asked to copy it closes the
    # object, and the grammar keeps it one JSON object.
    assert response.choices[0].finish_reason == "stop"
    assert json.loads(response.choices[0].message.content) == {"city": "Paris", "country": "France"}


def check_weather_call(call) -> None:
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("stack", ["pd", "tiny"])
def test_tool_choice_required_returns_a_valid_tool_call(stack, request):
    client = request.getfixturevalue(stack)[1]
    model = client.models.list().data[0].id
    response = client.chat.completions.create(
        model=model, messages=WEATHER_ASK, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, temperature=0.7, seed=3, max_tokens=120,
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    check_weather_call(choice.message.tool_calls[0])


def test_tool_choice_required_streamed_as_tool_call_deltas(tiny):
    _, client, _ = tiny
    stream = client.chat.completions.create(
        model=HUB_ID, messages=WEATHER_ASK, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, temperature=0.7, seed=4, max_tokens=120, stream=True,
    )  # fmt: skip
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert [r for r in reasons if r] == ["tool_calls"] and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_a_named_tool_choice_calls_that_function(tiny):
    _, client, _ = tiny
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(
        model=HUB_ID, messages=WEATHER_ASK, tools=[WEATHER], tool_choice=named,
        temperature=0, max_tokens=120,
    )  # fmt: skip
    check_weather_call(response.choices[0].message.tool_calls[0])


def test_a_tool_result_in_the_history_is_rendered_by_the_template(tiny):
    stack, client, tokenizer = tiny
    messages = [
        *WEATHER_ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]  # fmt: skip
    response = client.chat.completions.create(
        model=HUB_ID, messages=messages, tools=[WEATHER], temperature=0, max_tokens=4
    )
    local = dict(messages[1], tool_calls=[{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}])  # fmt: skip
    expected = tokenizer.apply_chat_template(
        [messages[0], local, messages[2]],
        tools=[WEATHER],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tokenizer.encode(expected, add_special_tokens=False)
    assert response.usage.prompt_tokens == len(ids)
    served = httpx.post(stack.url + "/tokenize", json={"messages": messages, "tools": [WEATHER]})
    assert served.json()["tokens"] == ids
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in expected


@pytest.mark.parametrize("stack", ["pd", "tiny"])
def test_n_3_returns_three_choices(stack, request):
    client = request.getfixturevalue(stack)[1]
    model = client.models.list().data[0].id
    response = client.chat.completions.create(
        model=model, messages=ASK, n=3, temperature=0.8, seed=5, max_tokens=12
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in response.choices)
    assert (
        response.usage.completion_tokens
        == sum(len(c.logprobs.content) if c.logprobs else 0 for c in response.choices)
        or response.usage.completion_tokens > 0
    )
    stack_obj = request.getfixturevalue(stack)[0]
    mode = "decode" if stack == "pd" else "colocated"
    stack_obj.wait_for(
        lambda: stack_obj.node(mode)["load"]["used_blocks"] == 0, "every sample's blocks freed"
    )


def test_logit_bias_of_minus_100_removes_the_greedy_token(pd):
    stack, client, model = pd
    prompt = "The capital of France is"
    first = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=1)
    token = stack_tokens(stack, first.choices[0].text)
    assert len(token) == 1
    banned = client.completions.create(
        model=model, prompt=prompt, temperature=0, max_tokens=1, logit_bias={str(token[0]): -100}
    )
    assert banned.choices[0].text != first.choices[0].text


def stack_tokens(stack, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    return httpx.post(stack.url + "/tokenize", json=body).json()["tokens"]


REFUSED = {
    "best_of": 2,
    "echo": True,
    "guided_json": {"type": "object"},
    "use_beam_search": True,
    "reasoning_effort": "high",
    "an_unknown_field": 1,
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_a_refused_field_is_a_400_naming_it(pd, field):
    _, client, model = pd
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=ASK, max_tokens=2, extra_body={field: REFUSED[field]}
        )
    assert info.value.body["param"] == field and field in info.value.body["message"]
