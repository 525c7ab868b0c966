"""The embedded SmolLM2 model: our greedy output equals HF `generate()` token for token (fp32)."""

from __future__ import annotations

import pytest

from common import SamplingParams
from common.text.tokenizer import apply_chat_template
from tests.hf_oracle import hf_greedy

CHATS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in three sentences why the sky is blue.",
    "List five fruits and one fact about each.",
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def chat_prompts(smollm_llm):
    return [
        apply_chat_template(smollm_llm.tokenizer, [{"role": "user", "content": c}]) for c in CHATS
    ]


def test_greedy_chat_answers_equal_hf_generate_token_for_token(smollm_llm, smollm_hf, chat_prompts):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = smollm_llm.generate(chat_prompts, params)
    for prompt, out in zip(chat_prompts, ours, strict=True):
        assert len(out.token_ids) == NEW_TOKENS
        assert out.token_ids == hf_greedy(smollm_hf, prompt, NEW_TOKENS)


def test_capital_of_france_answer_mentions_paris(smollm_llm):
    out = smollm_llm.chat(
        [{"role": "user", "content": CHATS[0]}], SamplingParams(temperature=0, max_tokens=32)
    )
    assert "Paris" in out[0].text
    assert out[0].finish_reason == "stop"


def test_text_prompt_is_tokenized_and_detokenized(smollm_llm):
    out = smollm_llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=8)
    )[0]
    assert out.text == smollm_llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.finish_reason == "length"


def test_stop_string_ends_generation_and_is_not_returned(smollm_llm):
    prompt = "Count from one to ten: one, two, three,"
    full = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16))[0].text
    assert "five" in full
    out = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop=["five"]))[
        0
    ]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index("five")]
