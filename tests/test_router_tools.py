"""Tool calling in the router: the parsers (Hermes/Qwen `<tool_call>` blocks, Llama 3.1 JSON),
streamed tool-call deltas, and requests with tools through the real app (loopback nodes)."""

from __future__ import annotations

import json

import pytest

from router.protocol import ChatCompletionRequest
from router.session import Delta
from router.tools import ToolCallStream, ToolPlan, ToolShaper, grammar_schema, plan_tools
from tests.test_router_api_errors import CHAT, assert_openai_error, call
from tests.test_router_api_fields import make_app, sent_prompt
from tests.test_router_api_generation import sse_events
from tests.tiny_models import QWEN_TOOL_TEMPLATE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
HERMES = ToolPlan("auto", [WEATHER], "hermes")
LLAMA = ToolPlan("auto", [WEATHER], "llama3_json")
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def run(plan: ToolPlan, pieces: list[str]) -> tuple[str, list[dict]]:
    stream, text, calls = ToolCallStream(plan), "", []
    for piece in pieces:
        t, c = stream.feed(piece)
        text, calls = text + t, calls + c
    t, c = stream.finish()
    return text + t, calls + c


def chars(text: str) -> list[str]:
    return list(text)


@pytest.mark.parametrize("split", [lambda s: [s], chars], ids=["whole", "char-by-char"])
def test_hermes_blocks_become_tool_calls_and_the_text_before_stays_content(split):
    text, calls = run(HERMES, split("Let me check. " + CALL_TEXT + "\n" + CALL_TEXT))
    assert text == "Let me check. "
    assert [c["index"] for c in calls] == [0, 1]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["type"] == "function"


def test_hermes_holds_back_only_what_could_start_a_tool_call():
    stream = ToolCallStream(HERMES)
    assert stream.feed("a < b <tool") == ("a < b ", [])
    assert stream.feed("tip>") == ("<tooltip>", [])


def test_an_unparsable_tool_call_block_is_returned_as_content():
    assert run(HERMES, ["<tool_call>{not json"]) == ("<tool_call>{not json", [])
    assert run(HERMES, ["just text"]) == ("just text", [])


def test_an_unclosed_but_complete_hermes_call_at_the_end_still_counts():
    text, calls = run(HERMES, ['<tool_call>{"name": "get_weather", "arguments": {}}'])
    assert text == "" and calls[0]["function"]["name"] == "get_weather"


def test_llama3_json_calls_with_python_tag_and_several_calls():
    one = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    text, calls = run(LLAMA, chars("<|python_tag|>" + one + "; " + one))
    assert text == "" and len(calls) == 2
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo"}
    assert run(LLAMA, chars("Hello {there}")) == ("Hello {there}", [])


def test_constrained_plans_parse_their_json_output():
    named = ToolPlan("named", [WEATHER], "hermes", function="get_weather")
    assert run(named, ['{"city": "Rome"}'])[1][0]["function"]["name"] == "get_weather"
    required = ToolPlan("required", [WEATHER], "hermes")
    text, calls = run(required, ['[{"name": "get_weather", "arguments": {"city": "Rome"}}]'])
    assert text == "" and json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    schema = grammar_schema(ToolPlan("required", [WEATHER], "hermes", parallel=False))
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}


def test_the_shaper_says_tool_calls_when_a_choice_that_stopped_called_a_tool():
    shaper = ToolShaper(HERMES)
    first = shaper.shape(Delta("Sure. " + CALL_TEXT[:20]))
    last = shaper.shape(Delta(CALL_TEXT[20:], finish_reason="stop"))
    assert first.text == "Sure. " and first.tool_calls is None
    assert last.finish_reason == "tool_calls" and len(last.tool_calls) == 1
    assert ToolShaper(None).shape(Delta("x", finish_reason="stop")).finish_reason == "stop"


def plan_of(**body) -> ToolPlan | None:
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user"}], **body})
    return plan_tools(request, "hermes")


def test_tool_choice_plans():
    assert plan_of() is None and plan_of(tools=[WEATHER], tool_choice="none") is None
    assert plan_of(tools=[WEATHER]).mode == "auto"
    assert plan_of(tools=[WEATHER], tool_choice="required").constrained
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert plan_of(tools=[WEATHER], tool_choice=named).function == "get_weather"


@pytest.fixture
def tool_app(source, tokenizer):
    tokenizer = type(tokenizer).from_pretrained(str(source.directory))
    tokenizer.chat_template = QWEN_TOOL_TEMPLATE
    answer = tokenizer.encode("Checking. " + CALL_TEXT, add_special_tokens=False)
    return make_app(source, tokenizer, answer), tokenizer


def test_an_auto_tool_call_comes_back_as_tool_calls_whole_and_streamed(tool_app):
    app, _ = tool_app
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}
    choice = call(app, "POST", CHAT, body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking. "
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris"
    }
    events = sse_events(call(app, "POST", CHAT, {**body, "stream": True}))[:-1]
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert (
        len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    )
    assert "".join(d.get("content") or "" for d in deltas) == "Checking. "
    assert [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][
        -1
    ] == "tool_calls"


def test_tool_history_is_rendered_by_the_template_not_flattened(tool_app):
    app, tokenizer = tool_app
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]  # fmt: skip
    assert call(app, "POST", CHAT, {"messages": messages, "tools": [WEATHER]}).status_code == 200
    prompt = tokenizer.decode(sent_prompt(app))
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in prompt
    )
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    tool_list = prompt.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(tool_list)["function"]["name"] == "get_weather"


def test_enable_thinking_reaches_the_template(tool_app):
    app, tokenizer = tool_app
    hi = [{"role": "user", "content": "hi"}]
    call(app, "POST", CHAT, {"messages": hi, "chat_template_kwargs": {"enable_thinking": False}})
    assert tokenizer.decode(sent_prompt(app)).endswith("<think>\n\n</think>\n\n")


def test_bad_tool_requests_are_400s_naming_the_field(tool_app):
    app, _ = tool_app
    hi = [{"role": "user", "content": "hi"}]
    named = {"type": "function", "function": {"name": "nope"}}
    assert_openai_error(
        call(app, "POST", CHAT, {"messages": hi, "tools": [WEATHER], "tool_choice": named}),
        400,
        "tool_choice",
    )
    assert_openai_error(
        call(app, "POST", CHAT, {"messages": hi, "tool_choice": "required"}), 400, "tool_choice"
    )
    bad_args = [
        *hi,
        {
            "role": "assistant",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}],
        },
    ]
    assert_openai_error(call(app, "POST", CHAT, {"messages": bad_args}), 400, "messages")
    assert_openai_error(
        call(app, "POST", CHAT, {"messages": hi, "tools": [{"type": "web"}]}), 400, "tools"
    )
