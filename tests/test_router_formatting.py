"""OpenAI response bodies and SSE chunks, without a server."""

from __future__ import annotations

import json

from router.formatting import SSE_DONE, ResponseFormatter, sse
from router.session import Delta, TokenPiece


class LetterTokenizer:
    """Token i decodes to the i-th lowercase letter: enough to check token strings."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def chat(**kwargs) -> ResponseFormatter:
    return ResponseFormatter("chat", "chatcmpl-1", "m", 123, LetterTokenizer(), **kwargs)


def completion(**kwargs) -> ResponseFormatter:
    return ResponseFormatter("completion", "cmpl-1", "m", 123, LetterTokenizer(), **kwargs)


def test_sse_events_are_data_lines_with_compact_json():
    assert sse({"a": 1, "b": "é"}) == 'data: {"a":1,"b":"é"}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"


def test_first_chat_chunk_carries_the_role_and_later_ones_do_not():
    fmt = chat()
    first = fmt.chunk(Delta("Hel", [TokenPiece(0)]))
    second = fmt.chunk(Delta("lo", [TokenPiece(1)]))
    assert first == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 123,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": "Hel"},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    assert second["choices"][0]["delta"] == {"content": "lo"}


def test_final_chunk_has_finish_reason_and_timing_and_an_empty_delta_when_no_text():
    fmt = chat()
    fmt.chunk(Delta("x", [TokenPiece(0)]))
    last = fmt.chunk(Delta("", [], "stop"), timing={"ttft": 0.1})
    assert last["choices"][0]["delta"] == {}
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["timing"] == {"ttft": 0.1}


def test_every_token_gets_a_chunk_even_with_no_text_so_clients_can_time_tokens():
    text_chunk = completion().chunk(Delta("", [TokenPiece(3)]))
    assert text_chunk is not None and text_chunk["choices"][0]["text"] == ""
    fmt = chat()
    fmt.chunk(Delta("x", [TokenPiece(0)]))
    assert fmt.chunk(Delta("", [TokenPiece(1)]))["choices"][0]["delta"] == {"content": ""}


def test_a_delta_with_no_tokens_no_text_and_no_finish_gets_no_chunk():
    assert completion().chunk(Delta("", [])) is None
    fmt = chat()
    fmt.chunk(Delta("x", [TokenPiece(0)]))
    assert fmt.chunk(Delta("", [])) is None


def test_include_usage_adds_null_usage_to_chunks_and_a_final_usage_chunk():
    fmt = completion(include_usage=True)
    chunk = fmt.chunk(Delta("ab", [TokenPiece(0)]))
    assert chunk["object"] == "text_completion" and chunk["usage"] is None
    assert chunk["choices"][0]["text"] == "ab"
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    final = fmt.usage_chunk(usage, {"e2e": 1.0})
    assert final["choices"] == [] and final["usage"] == usage and final["timing"] == {"e2e": 1.0}


def test_chat_logprobs_follow_openai_shape():
    fmt = chat(logprobs=True)
    piece = TokenPiece(1, -0.25, ((1, -0.25), (2, -1.5)))
    choice = fmt.chunk(Delta("b", [piece]))["choices"][0]
    assert choice["logprobs"] == {
        "content": [
            {
                "token": "b",
                "logprob": -0.25,
                "bytes": [98],
                "top_logprobs": [
                    {"token": "b", "logprob": -0.25, "bytes": [98]},
                    {"token": "c", "logprob": -1.5, "bytes": [99]},
                ],
            }
        ],
        "refusal": None,
    }


def test_completion_logprobs_track_text_offsets_across_chunks():
    fmt = completion(logprobs=True)
    first = fmt.chunk(Delta("ab", [TokenPiece(0, -0.1, ((0, -0.1),)), TokenPiece(1, -0.2, None)]))
    second = fmt.chunk(Delta("c", [TokenPiece(2, float("-inf"), ((2, float("-inf")),))]))
    assert first["choices"][0]["logprobs"] == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"a": -0.1}, None],
        "text_offset": [0, 1],
    }
    lp = second["choices"][0]["logprobs"]
    assert lp["text_offset"] == [2]
    assert lp["token_logprobs"] == [-9999.0] and lp["top_logprobs"] == [{"c": -9999.0}]
    json.loads(sse(second)[len("data: ") :])  # strict JSON: no -Infinity


def test_non_streaming_bodies():
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    body = chat().response([Delta("hi", [TokenPiece(0)], "length")], usage, {"e2e": 0.5})
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi", "refusal": None},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert body["usage"] == usage and body["timing"] == {"e2e": 0.5}
    text = completion().response([Delta("hi", [], "stop")], usage, {})
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "hi"


def test_tool_calls_in_a_body_and_in_stream_chunks():
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}  # fmt: skip
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    body = chat().response([Delta(" ", [], "tool_calls", tool_calls=[call])], usage, {})
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"] == [
        {k: v for k, v in call.items() if k != "index"}
    ]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    fmt = chat()
    first = fmt.chunk(Delta("", [], tool_calls=[call]))
    assert first["choices"][0]["delta"] == {"role": "assistant", "tool_calls": [call]}


def test_several_choices_get_their_own_index_role_and_text_offsets():
    fmt = ResponseFormatter("chat", "c", "m", 1, None)
    a, b = fmt.chunk(Delta("x", index=0)), fmt.chunk(Delta("y", index=2))
    assert a["choices"][0]["index"] == 0 and b["choices"][0]["index"] == 2
    assert a["choices"][0]["delta"]["role"] == b["choices"][0]["delta"]["role"] == "assistant"
    assert "role" not in fmt.chunk(Delta("z", index=2))["choices"][0]["delta"]


def test_without_a_tokenizer_tokens_are_named_by_id():
    fmt = ResponseFormatter("completion", "c", "m", 1, None, logprobs=True)
    chunk = fmt.chunk(Delta("", [TokenPiece(17, -1.0, None)]))
    assert chunk["choices"][0]["logprobs"]["tokens"] == ["token_id:17"]
