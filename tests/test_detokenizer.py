"""Incremental detokenization with stop strings, on the embedded model's real tokenizer."""

from __future__ import annotations

import pytest

from common.text.detokenizer import IncrementalDetokenizer

TEXT = " b b b x"  # one token per word: " b", " b", " b", " x"


def run(tokenizer, stop: list[str], min_tokens: int = 0) -> IncrementalDetokenizer:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) == 4
    detok = IncrementalDetokenizer(tokenizer, [1], stop, min_tokens=min_tokens)
    for token in ids:
        detok.add([token])
        if detok.stopped_on is not None:
            break
    return detok


@pytest.mark.parametrize(
    "min_tokens,stop,text",
    [
        (0, "b", " "),
        (2, "b", " b b "),  # vLLM: a stop string ends the output from token min_tokens + 1
        (3, "b", TEXT),  # the first 3 tokens' text is never searched on its own
        (3, "b x", " b b "),  # a match may start in it and end in a later token
    ],
)
def test_stop_strings_wait_for_min_tokens(tokenizer, min_tokens, stop, text):
    detok = run(tokenizer, [stop], min_tokens)
    assert detok.text == text
    assert detok.stopped_on == (None if text == TEXT else stop)


def test_min_tokens_counts_tokens_fed_in_one_call(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1], ["b"], min_tokens=2)
    detok.add(ids)
    assert (detok.text, detok.stopped_on) == (" b b ", "b")
