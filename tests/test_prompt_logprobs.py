"""Prompt logprobs without a server: the engine's chunked computation against HF transformers
(fp32, the embedded model), the rows each step collects, the wire message, the response shapes
built from them (completions echo, vLLM's `prompt_logprobs` field), and what the router asks
the nodes for (the real app, loopback nodes)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from common import LLM, SamplingParams
from common.engine.prompt_logprobs import PromptRows, prompt_rows
from common.engine.scheduler import ScheduledBatch, ScheduledSeq
from common.engine.sequence import Sequence
from common.protocol.messages import (
    FirstToken,
    MessageError,
    PrefillRequest,
    PromptLogprobs,
    TokenBatch,
    decode,
    encode,
)
from router.formatting import ResponseFormatter
from router.prepare import PromptReturn
from router.session import Delta, TokenPiece
from tests.test_router_api_errors import CHAT, HI, TEXT, assert_openai_error, call
from tests.test_router_api_fields import make_app
from tests.test_router_formatting import LetterTokenizer

PROMPT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France, Berlin is "
    "the capital of Germany, and Rome is the capital of"
)
ATOL = 1e-3  # fp32 on both sides; different kernels and summation orders


@pytest.fixture(scope="module")
def prompt_ids(smollm_llm) -> list[int]:
    return smollm_llm.encode(PROMPT)


@pytest.fixture(scope="module")
def hf_logprobs(smollm_hf, prompt_ids) -> torch.Tensor:
    """[prompt - 1, vocab]: row i is the distribution of prompt token i + 1."""
    with torch.inference_mode():
        logits = smollm_hf(torch.tensor([prompt_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def offline(llm: LLM, ids: list[int], k: int) -> PromptLogprobs:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
    out = llm.generate(ids, params)[0]
    assert out.prompt_logprobs is not None
    return out.prompt_logprobs


def test_offline_prompt_logprobs_equal_hf_transformers(smollm_llm, prompt_ids, hf_logprobs):
    plp = offline(smollm_llm, prompt_ids, 5)
    n = len(prompt_ids)
    assert plp.num_rows == n - 1 and plp.top_k == 5
    target = torch.tensor(prompt_ids[1:])
    expected = hf_logprobs.gather(1, target[:, None]).squeeze(1)
    np.testing.assert_allclose(plp.logprobs, expected.numpy(), atol=ATOL)
    expected_ranks = (hf_logprobs > expected[:, None]).sum(-1) + 1
    assert plp.ranks.tolist() == expected_ranks.tolist()
    top = hf_logprobs.topk(5, dim=-1)
    np.testing.assert_allclose(plp.top_logprobs.reshape(n - 1, 5), top.values.numpy(), atol=ATOL)
    assert plp.top_ids.reshape(n - 1, 5).tolist() == top.indices.tolist()


def test_chunked_prefill_gives_the_same_prompt_logprobs_as_one_step(smollm_llm, prompt_ids):
    """8-token steps: every chunk projects its own rows, and they join in prompt order."""
    assert len(prompt_ids) > 3 * 8
    chunked = LLM(device="cpu", max_num_batched_tokens=8)
    try:
        small = offline(chunked, prompt_ids, 3)
    finally:
        chunked.close()
    whole = offline(smollm_llm, prompt_ids, 3)
    np.testing.assert_allclose(small.logprobs, whole.logprobs, atol=ATOL)
    assert small.ranks.tolist() == whole.ranks.tolist()
    assert small.top_ids.tolist() == whole.top_ids.tolist()


def test_a_cached_prompt_is_computed_again_for_its_logprobs(smollm_llm, prompt_ids):
    """Prefix caching is on: a second identical prompt would hit the cache, whose blocks have
    no logits; a request asking for prompt logprobs matches no prefix."""
    plain = SamplingParams(temperature=0, max_tokens=1)
    smollm_llm.generate(prompt_ids, plain)
    assert smollm_llm.generate(prompt_ids, plain)[0].num_cached_tokens > 0
    first = offline(smollm_llm, prompt_ids, 0)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    again = smollm_llm.generate(prompt_ids, params)[0]
    assert again.num_cached_tokens == 0
    assert again.prompt_logprobs.logprobs.tolist() == first.logprobs.tolist()
    assert first.top_ids.size == 0


def sequence(n: int, k: int | None = 2) -> Sequence:
    return Sequence("r", list(range(n)), SamplingParams(prompt_logprobs=k))


def part(rows: int) -> PromptLogprobs:
    return PromptLogprobs(0, np.zeros(rows), np.ones(rows, dtype=np.int32), [], [])


def test_each_step_collects_the_rows_of_its_own_prompt_chunks():
    a, b, plain = sequence(10), sequence(4), sequence(6, None)
    batch = ScheduledBatch(
        [ScheduledSeq(plain, 0, 6), ScheduledSeq(a, 0, 5), ScheduledSeq(b, 0, 4)]
    )
    # a: positions 0..4 predict tokens 1..5; b's last position predicts its first output.
    assert prompt_rows(batch) == [PromptRows(a, 6, 0, 5), PromptRows(b, 11, 0, 3)]
    a.prompt_logprob_parts.append(part(5))
    assert prompt_rows(ScheduledBatch([ScheduledSeq(a, 5, 5)])) == [PromptRows(a, 0, 5, 4)]


def test_a_recompute_collects_only_missing_rows_and_a_fork_collects_none():
    seq = sequence(10)
    seq.prompt_logprob_parts.append(part(4))  # preempted after its first chunk
    assert prompt_rows(ScheduledBatch([ScheduledSeq(seq, 0, 8)])) == [PromptRows(seq, 4, 4, 4)]
    seq.prompt_logprob_parts.append(part(5))  # complete: a recompute collects nothing
    assert prompt_rows(ScheduledBatch([ScheduledSeq(seq, 0, 10)])) == []
    fork = sequence(10)  # n > 1: starts on its parent's prompt blocks, past its own rows
    assert prompt_rows(ScheduledBatch([ScheduledSeq(fork, 8, 2)])) == []


def sample_logprobs() -> PromptLogprobs:
    """Two rows (prompt tokens 1 and 2), top 2 each."""
    return PromptLogprobs(
        2,
        [-1.5, -0.25],
        [3, 1],
        [4, 5, 2, 0],
        [-0.5, -1.0, -0.25, -2.0],
    )


def test_prompt_logprobs_travel_as_arrays_in_first_token_and_token_batch():
    plp = sample_logprobs()
    first = FirstToken("r", 7, None, None, False, None, 0, {}, prompt_logprobs=plp)
    batch = TokenBatch(["r", "r"], [7, 8], [None, None], prompt_logprobs={"r": plp})
    for back in (
        decode(encode(first)).prompt_logprobs,
        decode(encode(batch)).items()[0].prompt_logprobs,
    ):
        assert back.top_k == 2
        assert back.logprobs.dtype == np.dtype("<f4") and back.logprobs.tolist() == [-1.5, -0.25]
        assert back.ranks.tolist() == [3, 1] and back.top_ids.tolist() == [4, 5, 2, 0]
    assert decode(encode(batch)).items()[1].prompt_logprobs is None  # first row only
    assert (
        decode(encode(FirstToken("r", 7, None, None, False, None, 0, {}))).prompt_logprobs is None
    )


def test_malformed_prompt_logprobs_are_refused():
    with pytest.raises(MessageError, match="top ids"):
        PromptLogprobs(2, [-1.0], [1], [4], [-0.5])
    with pytest.raises(MessageError, match="ranks"):
        PromptLogprobs(0, [-1.0, -2.0], [1], [], [])


def echo_formatter(**prompt) -> ResponseFormatter:
    return ResponseFormatter(
        "completion", "cmpl-1", "m", 1, LetterTokenizer(), logprobs=True,
        prompt=PromptReturn([0, 1, 2], **prompt),
    )  # fmt: skip


def test_echo_with_logprobs_puts_the_prompt_tokens_first_the_first_with_null_logprobs():
    fmt = echo_formatter(echo="abc", top_logprobs=1)
    generated = Delta("d", [TokenPiece(3, -0.75, ((3, -0.75),))], "length")
    choice = fmt.response([generated], {}, {}, sample_logprobs())["choices"][0]
    assert choice["text"] == "abcd"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "c", "d"]
    assert lp["token_logprobs"] == [None, -1.5, -0.25, -0.75]
    # each prompt token's top entries (1 here), then itself unless among them (vLLM's echo)
    assert lp["top_logprobs"] == [None, {"e": -0.5, "b": -1.5}, {"c": -0.25}, {"d": -0.75}]
    assert lp["text_offset"] == [0, 1, 2, 3]
    for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert choice["text"][offset : offset + len(token)] == token


def test_a_streamed_echo_comes_in_each_choice_first_chunk_only():
    fmt = echo_formatter(echo="abc", top_logprobs=1)
    first = fmt.chunk(Delta("d", [TokenPiece(3, -0.75)]), prompt_logprobs=sample_logprobs())
    second = fmt.chunk(Delta("e", [TokenPiece(4, -0.5)], "length"))
    assert first["choices"][0]["text"] == "abcd"
    assert first["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.5, -0.25, -0.75]
    assert second["choices"][0]["text"] == "e"
    assert second["choices"][0]["logprobs"]["text_offset"] == [4]


def test_prompt_logprobs_field_follows_vllm():
    fmt = echo_formatter(prompt_logprobs=1)
    choice = fmt.response([Delta("d", [], "length")], {}, {}, sample_logprobs())["choices"][0]
    assert choice["text"] == "d"  # no echo asked
    assert choice["prompt_logprobs"] == [
        None,
        {
            "1": {"logprob": -1.5, "rank": 3, "decoded_token": "b"},
            "4": {"logprob": -0.5, "rank": 1, "decoded_token": "e"},
        },
        {"2": {"logprob": -0.25, "rank": 1, "decoded_token": "c"}},
    ]
    chat = ResponseFormatter(
        "chat", "c", "m", 1, LetterTokenizer(), prompt=PromptReturn([0, 1, 2], prompt_logprobs=0)
    )
    body = chat.response([Delta("d", [], "stop")], {}, {}, sample_logprobs())
    assert body["prompt_logprobs"][1] == {"1": {"logprob": -1.5, "rank": 3, "decoded_token": "b"}}
    assert "prompt_logprobs" not in body["choices"][0]
    json.dumps(body, allow_nan=False)


def test_continuous_usage_puts_usage_in_every_chunk():
    fmt = ResponseFormatter(
        "chat", "c", "m", 1, LetterTokenizer(), include_usage=True, continuous_usage=True
    )
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    assert fmt.chunk(Delta("a", [TokenPiece(0)]), usage=usage)["usage"] == usage
    # vLLM: without include_usage, continuous_usage_stats adds nothing
    quiet = ResponseFormatter("chat", "c", "m", 1, LetterTokenizer(), continuous_usage=True)
    assert "usage" not in quiet.chunk(Delta("a", [TokenPiece(0)]), usage=usage)


@pytest.fixture
def app(source, tokenizer):
    return make_app(source, tokenizer, [28120, 905])


def sent_sampling(app) -> SamplingParams:
    return app.state.core.link.sent_of(PrefillRequest)[-1][1].sampling


def test_echo_and_max_tokens_zero_ask_the_nodes_for_prompt_logprobs_and_one_token(app):
    body = {"prompt": "a b", "echo": True, "logprobs": 1, "max_tokens": 0}
    assert call(app, "POST", TEXT, body).status_code == 200
    sampling = sent_sampling(app)
    assert sampling.prompt_logprobs == 1 and sampling.max_tokens == 1
    body = {"messages": HI, "prompt_logprobs": 3, "logprobs": True, "top_logprobs": 5}
    assert call(app, "POST", CHAT, body).status_code == 200
    assert sent_sampling(app).prompt_logprobs == 3  # the field's k, not top_logprobs


BAD = [
    (TEXT, {"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
    (TEXT, {"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs"),
    (CHAT, {"messages": HI, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    (TEXT, {"prompt": "a", "max_tokens": 0, "min_tokens": 1}, "min_tokens"),
    (CHAT, {"messages": HI, "echo": True}, "echo"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[p for _, _, p in BAD])
def test_bad_prompt_logprob_requests_are_400s_naming_the_field(app, path, body, param):
    assert_openai_error(call(app, "POST", path, body), 400, param)
    assert app.state.core.link.sent == []
