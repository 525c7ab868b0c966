"""Prompt logprobs through real stacks (router and node processes, ZMQ, HTTP through the
`openai` client, the embedded model in fp32): PD, where the prefill node computes them in
16-token chunks and they travel back in FirstToken, and colocated, where the decode node does
and they travel in its first TokenBatch row. Both equal HF transformers on the same weights.
Also the request shapes lm-evaluation-harness and GuideLLM send."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch
from openai import OpenAI

from tests.pd_stack import PDStack

MODEL = "SmolLM2-135M-Instruct"
CHUNK = 16  # --max-num-batched-tokens: the prompts below take several prefill steps
PROMPT = (
    "Question: Which city is the capital of France, and which river flows through it?\n"
    "Answer: The capital of France is Paris, and the river that flows through it is the"
)
ATOL = 1e-3  # fp32 on both sides; different kernels and summation orders


def start(tmp_path_factory, name: str, *args: str):
    log = tmp_path_factory.mktemp(name) / "launch.log"
    stack = PDStack("--max-num-batched-tokens", str(CHUNK), *args, log_path=log)
    client = OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return stack, client


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    stack, client = start(tmp_path_factory, "pd")
    yield stack, client
    assert stack.stop() == [], "processes left after Ctrl-C"


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    stack, client = start(tmp_path_factory, "colocated", "--colocated")
    yield stack, client
    assert stack.stop() == [], "processes left after Ctrl-C"


@pytest.fixture(scope="module")
def prompt_ids(pd) -> list[int]:
    stack, _ = pd
    body = {"prompt": PROMPT, "add_special_tokens": True}
    ids = httpx.post(stack.url + "/tokenize", json=body).json()["tokens"]
    assert len(ids) > 2 * CHUNK
    return ids


@pytest.fixture(scope="module")
def hf_token_logprobs(smollm_hf, prompt_ids) -> np.ndarray:
    """HF's logprob of each prompt token but the first, given the ones before it."""
    with torch.inference_mode():
        logits = smollm_hf(torch.tensor([prompt_ids])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, torch.tensor(prompt_ids[1:])[:, None]).squeeze(1).numpy()


def echo_logprobs(client: OpenAI, max_tokens: int):
    """What lm-evaluation-harness sends for a loglikelihood request."""
    return client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0
    ).choices[0]


@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_echo_with_logprobs_gives_the_prompt_logprobs_of_hf_transformers(
    mode, request, prompt_ids, hf_token_logprobs
):
    _, client = request.getfixturevalue(mode)
    choice = echo_logprobs(client, max_tokens=1)
    n = len(prompt_ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:n], hf_token_logprobs, atol=ATOL)
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert choice.finish_reason == "length"
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        assert choice.text[offset : offset + len(token)] == token
    # lm-eval's is_greedy reads the top entries: the best one's logprob bounds the token's
    for token_logprob, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert max(top.values()) >= token_logprob - 1e-6


def test_max_tokens_zero_echoes_only_the_prompt(pd, prompt_ids):
    _, client = pd
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0
    )
    choice = response.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(prompt_ids)
    assert response.usage.completion_tokens == 0
    assert response.usage.prompt_tokens == len(prompt_ids)


def test_prompt_logprobs_field_on_both_endpoints(pd, prompt_ids, hf_token_logprobs):
    stack, client = pd
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    field = completion.choices[0].model_extra["prompt_logprobs"]
    assert len(field) == len(prompt_ids) and field[0] is None
    for i, entries in enumerate(field[1:]):
        token = entries[str(prompt_ids[i + 1])]
        assert token["logprob"] == pytest.approx(float(hf_token_logprobs[i]), abs=ATOL)
        assert token["rank"] >= 1 and isinstance(token["decoded_token"], str)
        # the prompt token first, then the top 2 (ranks 1 and 2) unless it is one of them
        assert len(entries) in (2, 3) and {e["rank"] for e in entries.values()} >= {1, 2}
    chat = httpx.post(
        stack.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
              "prompt_logprobs": 0},
    ).json()  # fmt: skip
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert chat["prompt_logprobs"][0] is None
    assert all(len(entries) == 1 for entries in chat["prompt_logprobs"][1:])
    assert chat["choices"][0]["message"]["refusal"] is None


def test_prompt_logprobs_refuse_a_stream(pd):
    stack, _ = pd
    body = {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1, "stream": True}
    response = httpx.post(stack.url + "/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt_logprobs"


def stream(stack: PDStack, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", stack.url + path, json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_requests_get_usage_in_every_chunk(pd, path):
    """GuideLLM 0.8's body: continuous usage, stop null, ignore_eos, a max token count."""
    stack, _ = pd
    body = {
        "model": MODEL,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "stop": None,
        "ignore_eos": True,
    }
    if path.endswith("chat/completions"):
        content = [{"type": "text", "text": "Tell me about Paris."}]
        body.update(messages=[{"role": "user", "content": content}], max_completion_tokens=6)
    else:
        body.update(prompt="Tell me about Paris.", max_tokens=6)
    chunks = stream(stack, path, body)
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices and all(c["usage"] is not None for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
