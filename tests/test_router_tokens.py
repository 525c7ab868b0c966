"""`/tokenize`, `/detokenize`, `/version` and the `/v1/models` card (real app, loopback nodes)."""
# ruff: noqa: F811  (the `app` fixture imported from test_router_api_fields is re-bound as an argument)

from __future__ import annotations

from transformers import AutoTokenizer

from tests.test_router_api_errors import CHAT, HI, assert_openai_error, call
from tests.test_router_api_fields import app, sent_prompt  # noqa: F401


def test_tokenize_a_prompt_and_detokenize_it_back(app, tokenizer):
    response = call(app, "POST", "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    body = response.json()
    assert body["tokens"] == tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 2048
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    back = call(app, "POST", "/detokenize", {"tokens": body["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(body["tokens"])}


def test_tokenize_messages_gives_the_prompt_a_chat_completion_sends(app):
    counted = call(app, "POST", "/tokenize", {"messages": HI, "model": "smol"}).json()
    assert call(app, "POST", CHAT, {"messages": HI, "max_tokens": 2}).status_code == 200
    assert sent_prompt(app) == counted["tokens"]


def test_tokenize_and_detokenize_refuse_bad_input(app):
    assert_openai_error(call(app, "POST", "/tokenize", {}), 400, "prompt")
    assert_openai_error(call(app, "POST", "/tokenize", {"prompt": "a", "messages": HI}), 400)
    assert_openai_error(call(app, "POST", "/tokenize", {"prompt": 3}), 400, "prompt")
    for messages in ([], [{"role": "user", "content": "hi"}]):
        body = {"messages": messages, "continue_final_message": True}
        param = "messages" if not messages else "continue_final_message"
        assert_openai_error(call(app, "POST", "/tokenize", body), 400, param)
    assert_openai_error(call(app, "POST", "/tokenize", {"prompt": "a", "model": "x"}), 404)
    assert_openai_error(call(app, "POST", "/detokenize", {"tokens": [10**9]}), 400, "tokens")
    assert_openai_error(call(app, "POST", "/detokenize", {"tokens": [1], "x": 1}), 400, "x")


def test_version_is_the_package_version(app):
    from importlib import metadata

    assert call(app, "GET", "/version").json() == {"version": metadata.version("pdserve")}


def test_models_root_is_a_path_a_tokenizer_loads_from(app, tokenizer):
    card = call(app, "GET", "/v1/models").json()["data"][0]
    assert card["id"] == "smol" and card["max_model_len"] == 2048
    loaded = AutoTokenizer.from_pretrained(card["root"])
    assert loaded.encode("Hello world") == tokenizer.encode("Hello world")
