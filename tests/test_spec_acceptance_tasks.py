"""The n-gram acceptance benchmark's tasks (`benchmarks/spec_acceptance.py`): each builder makes
prompts from real text on the machine, the same ones every time, and one short run of the
embedded model with speculation gives the tokens it gives without."""

from __future__ import annotations

import random
import re

import pytest
import torch

from benchmarks.spec_acceptance import (
    TASKS,
    compare,
    extract_prompts,
    misspell,
    sentences_with_word,
    spelling_prompts,
    summarize,
)
from common import LLM, SamplingParams


@pytest.mark.parametrize("task", list(TASKS))
def test_every_task_builds_the_same_distinct_prompts_twice(task):
    prompts = TASKS[task](6)
    assert len(prompts) == 6
    texts = [p.messages[-1]["content"] for p in prompts]
    assert len(set(texts)) == 6, "two prompts are the same"
    assert all(p.task == task and p.messages[-1]["role"] == "user" for p in prompts)
    assert [p.messages for p in TASKS[task](6)] == [p.messages for p in prompts]


def test_misspell_changes_exactly_the_asked_number_of_words_by_one_edit():
    text = "The licenses for most software are designed to take away your freedom to share it."
    wrong = misspell(text, 3, random.Random(1))
    before, after = text.split(), wrong.split()
    changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert len(changed) == 3
    for right, typo in changed:
        assert len(right) >= 5 and abs(len(typo) - len(right)) <= 1
        assert sorted(typo) == sorted(right) or len(typo) != len(right)
    assert misspell(text, 3, random.Random(1)) == wrong


def test_spelling_prompts_carry_misspelled_real_text():
    for prompt in spelling_prompts(4):
        text = prompt.messages[-1]["content"].split("Text:\n", 1)[1]
        assert len(text.split()) >= 40
        assert (
            prompt.source.startswith("/usr/share/common-licenses/") or ".__doc__" in prompt.source
        )


def test_extract_prompts_name_a_word_found_in_some_but_not_all_sentences():
    for prompt in extract_prompts(4):
        ask, text = prompt.messages[-1]["content"].split("Text:\n", 1)
        word = re.search(r'the word "(\w+)"', ask).group(1)
        sentences, found = sentences_with_word(text)
        assert found == word
        hits = [s for s in sentences if word in s.lower()]
        assert 2 <= len(hits) < len(sentences)


@pytest.fixture
def one_thread():
    # On cores shared with other work one torch thread runs this several times faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_short_speculating_run_gives_the_tokens_of_a_plain_run(one_thread):
    plain = LLM(device="cpu", enable_prefix_caching=False)
    speculating = LLM(
        device="cpu",
        enable_prefix_caching=False,
        speculative_method="ngram",
        num_speculative_tokens=4,
    )
    params = SamplingParams(temperature=0, max_tokens=24)
    row = compare(plain, speculating, extract_prompts(1)[0], params)
    assert row["identical"]
    assert row["output_tokens"] > 1
    # The answer copies the text: the lookup drafts, and the target keeps some of it.
    assert row["num_drafts"] > 0 and row["num_accepted_tokens"] > 0
    summary = summarize([row])
    assert summary["mean_accepted_length"] > 1.0 and summary["identical"]
