"""Every OpenAI / vLLM request field is honoured or refused with a 400 naming it (loopback
nodes, the real FastAPI app and the embedded tokenizer): nothing that changes the output is
silently dropped, and the shapes real clients (`vllm bench serve`, the openai client) send work.
"""

from __future__ import annotations

import json

import pytest

from common.protocol.messages import DecodeRequest, PrefillRequest
from common.protocol.sampling_params import SamplingParams
from router.app import create_app
from router.config import RouterConfig
from tests.router_fakes import LoopbackNodes, ManualClock, generation_script
from tests.test_router_api_errors import CHAT, HI, TEXT, assert_openai_error, beat, call

P, D = "tcp://127.0.0.1:5601", "tcp://127.0.0.1:5701"


def make_app(source, tokenizer, answer: list[int]):
    link = LoopbackNodes(generation_script(answer))
    config = RouterConfig(prefill=(P,), decode=(D,), served_model_name="smol")
    app = create_app(config, source=source, tokenizer=tokenizer, link=link, clock=ManualClock())
    link.deliver = app.state.core.on_message
    beat(app, max_model_len=2048)
    return app


@pytest.fixture
def app(source, tokenizer):
    return make_app(source, tokenizer, [28120, 905])


REFUSED = [
    (TEXT, "best_of", 3),
    (TEXT, "use_beam_search", True),
    (TEXT, "length_penalty", 0.5),
    (TEXT, "include_stop_str_in_output", True),
    (TEXT, "spaces_between_special_tokens", False),
    (TEXT, "truncate_prompt_tokens", 8),
    (TEXT, "guided_json", {"type": "object"}),
    (TEXT, "guided_regex", "a+"),
    (TEXT, "guided_choice", ["a", "b"]),
    (TEXT, "guided_grammar", "root ::= 'a'"),
    (TEXT, "suffix", "tail"),
    (CHAT, "functions", [{"name": "f"}]),
    (CHAT, "function_call", "auto"),
    (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "audio", {"voice": "x"}),
    (CHAT, "prediction", {"type": "content", "content": "x"}),
    (CHAT, "reasoning_effort", "high"),
    (CHAT, "web_search_options", {}),
    (CHAT, "echo", True),
    (CHAT, "mm_processor_kwargs", {"a": 1}),
    (CHAT, "a_field_nobody_knows", 1),
    (TEXT, "a_field_nobody_knows", "x"),
]


def body_for(path: str, **fields) -> dict:
    base = {"messages": HI} if path == CHAT else {"prompt": "a"}
    return {**base, "max_tokens": 2, **fields}


@pytest.mark.parametrize(
    "path,field,value", REFUSED, ids=[f"{p.split('/')[-1]}-{f}" for p, f, _ in REFUSED]
)
def test_a_field_that_would_change_the_output_is_refused_by_name(app, path, field, value):
    message = assert_openai_error(call(app, "POST", path, body_for(path, **{field: value})), 400)
    assert field in message
    assert app.state.core.link.sent == []


def test_an_unknown_field_inside_a_message_is_refused(app):
    body = {"messages": [{"role": "user", "content": "hi", "weird": 1}]}
    assert "weird" in assert_openai_error(call(app, "POST", CHAT, body), 400, "messages")


@pytest.mark.parametrize(
    "path,field,value",
    [
        (TEXT, "best_of", 1),
        (TEXT, "echo", False),
        (TEXT, "logprobs", None),
        (TEXT, "repetition_penalty", 1.0),
        (CHAT, "n", 1),
        (CHAT, "modalities", ["text"]),
        (CHAT, "user", "someone"),
        (CHAT, "store", False),
        (CHAT, "metadata", {"k": "v"}),
        (CHAT, "service_tier", "auto"),
        (CHAT, "tool_choice", "none"),
        (CHAT, "response_format", {"type": "text"}),
    ],
)
def test_neutral_values_of_known_fields_are_accepted(app, path, field, value):
    response = call(app, "POST", path, body_for(path, **{field: value}))
    assert response.status_code == 200, response.text


def sent_prompt(app, kind=PrefillRequest) -> list[int]:
    return [int(t) for t in app.state.core.link.sent_of(kind)[-1][1].prompt_token_ids]


def test_vllm_bench_serve_completion_payload_is_served(app):
    body = {
        "model": "smol",
        "prompt": "hello there",
        "temperature": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 2,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    response = call(app, "POST", TEXT, body)
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    sampling = app.state.core.link.sent_of(PrefillRequest)[-1][1].sampling
    assert sampling.ignore_eos is True and sampling.repetition_penalty == 1.0


def test_vllm_bench_serve_chat_payload_with_content_parts_is_served(app, tokenizer):
    body = {
        "model": "smol",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
        "temperature": 0.0,
        "max_completion_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert call(app, "POST", CHAT, body).status_code == 200
    plain = [{"role": "user", "content": "hello there"}]
    expected = tokenizer.apply_chat_template(plain, add_generation_prompt=True)["input_ids"]
    assert sent_prompt(app) == expected


def test_vllm_sampling_extensions_reach_the_nodes(app):
    body = body_for(
        TEXT,
        repetition_penalty=1.3,
        min_tokens=1,
        ignore_eos=True,
        stop_token_ids=[7, 9],
        top_k=5,
        min_p=0.1,
    )
    assert call(app, "POST", TEXT, body).status_code == 200
    for kind in (PrefillRequest, DecodeRequest):
        sampling = app.state.core.link.sent_of(kind)[-1][1].sampling
        assert sampling.repetition_penalty == 1.3 and sampling.min_tokens == 1
        assert sampling.ignore_eos and sampling.stop_token_ids == [7, 9]
        assert sampling.top_k == 5 and sampling.min_p == 0.1


def test_add_special_tokens_false_drops_the_bos_of_a_text_prompt(app, tokenizer):
    call(app, "POST", TEXT, body_for(TEXT, prompt="hello", add_special_tokens=False))
    assert sent_prompt(app) == tokenizer.encode("hello", add_special_tokens=False)


def test_continue_final_message_continues_the_assistant_turn(app, tokenizer):
    messages = [*HI, {"role": "assistant", "content": "Hello, I am"}]
    body = body_for(CHAT, messages=messages, continue_final_message=True)
    assert call(app, "POST", CHAT, body).status_code == 200
    text = tokenizer.decode(sent_prompt(app))
    assert text.endswith("Hello, I am")
    generation_prompt = body_for(CHAT, messages=messages, add_generation_prompt=True)
    assert call(app, "POST", CHAT, generation_prompt).status_code == 200
    assert tokenizer.decode(sent_prompt(app)).endswith("<|im_start|>assistant\n")


def test_continue_final_message_needs_an_assistant_message_last(app):
    body = body_for(CHAT, continue_final_message=True)
    assert_openai_error(call(app, "POST", CHAT, body), 400, "continue_final_message")


def test_chat_template_and_its_kwargs_are_honoured(app, tokenizer):
    template = "{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ flavour }}]{% endfor %}"
    body = body_for(CHAT, chat_template=template, chat_template_kwargs={"flavour": "mint"})
    assert call(app, "POST", CHAT, body).status_code == 200
    assert tokenizer.decode(sent_prompt(app)) == "[user|hi|mint]"


def test_skip_special_tokens_false_shows_special_tokens_in_the_text(source, tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    app = make_app(source, tokenizer, [im_end, *tokenizer.encode(" hello")])
    shown = call(app, "POST", TEXT, body_for(TEXT, max_tokens=8, skip_special_tokens=False))
    hidden = call(app, "POST", TEXT, body_for(TEXT, max_tokens=8))
    assert shown.json()["choices"][0]["text"] == "<|im_end|> hello"
    assert hidden.json()["choices"][0]["text"] == " hello"


def sent_sampling(app) -> SamplingParams:
    return app.state.core.link.sent_of(PrefillRequest)[-1][1].sampling


def test_response_format_becomes_a_grammar_spec_for_both_nodes(app):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert call(app, "POST", CHAT, body_for(CHAT, response_format=fmt)).status_code == 200
    for kind in (PrefillRequest, DecodeRequest):
        spec = app.state.core.link.sent_of(kind)[-1][1].sampling.structured
        assert spec["type"] == "json_schema" and json.loads(spec["schema"]) == schema
    assert call(app, "POST", TEXT, body_for(TEXT, response_format={"type": "json_object"}))
    assert sent_sampling(app).structured == {"type": "json_object"}


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "tomato"}}},
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "json_schema"},
        {"type": "yaml"},
    ],
)
def test_a_response_format_no_grammar_can_follow_is_a_400(app, fmt):
    response = call(app, "POST", CHAT, body_for(CHAT, response_format=fmt))
    assert_openai_error(response, 400, "response_format")
    assert app.state.core.link.sent == []


def test_forced_tool_choice_is_a_grammar_over_the_tool_calls(app):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = body_for(CHAT, tools=[tool], tool_choice="required")
    assert call(app, "POST", CHAT, body).status_code == 200
    schema = json.loads(sent_sampling(app).structured["schema"])
    assert schema["type"] == "array" and schema["minItems"] == 1
    named = {"type": "function", "function": {"name": "f"}}
    assert call(app, "POST", CHAT, body_for(CHAT, tools=[tool], tool_choice=named))
    assert json.loads(sent_sampling(app).structured["schema"]) == {"type": "object"}
    both = body_for(CHAT, tools=[tool], tool_choice=named, response_format={"type": "json_object"})
    assert_openai_error(call(app, "POST", CHAT, both), 400, "response_format")


def test_logit_bias_reaches_the_nodes_as_pairs_and_bad_ones_are_400s(app):
    assert call(app, "POST", TEXT, body_for(TEXT, logit_bias={"42": -100, "7": 5.5}))
    assert [list(p) for p in sent_sampling(app).logit_bias] == [[42, -100.0], [7, 5.5]]
    for bias in ({"x": 1}, {"1": 101}, {"49152": 1}):
        response = call(app, "POST", TEXT, body_for(TEXT, logit_bias=bias))
        assert_openai_error(response, 400, "logit_bias")
