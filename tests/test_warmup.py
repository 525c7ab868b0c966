"""The start-up warm-up of the sampled path (`common.engine.warmup`) on a tiny random model with
the embedded tokenizer, on CPU: it runs every kind of request through the runner's sampling,
leaves no request state behind and changes no result."""

from __future__ import annotations

import argparse
import json
import logging

import pytest

from common import LLM, SamplingParams
from common.engine.config import EngineConfig, add_dataclass_args, engine_config_from_args
from common.engine.warmup import GRAMMAR_ROWS, KINDS, STRUCTURED, warm_up
from tests.tiny_models import save_tiny_tool_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_tool_model(tmp_path_factory.mktemp("warm") / "model"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, device="cpu", warmup=False)


def assert_no_request_state(llm: LLM) -> None:
    runner = llm.engine.worker.runner
    assert len(runner.sampler.counts) == 0
    assert not runner.sampler._keys
    assert not runner.logits_processors._matchers


def test_warm_up_samples_every_kind_and_leaves_no_request_state(llm):
    pytest.importorskip("xgrammar")
    runner = llm.engine.worker.runner
    size = len(KINDS) + 3  # each kind, the grammar row, then filler rows
    report = warm_up(llm.engine.worker, sizes=[1, size], grammar=True)
    assert report.grammar and not report.verify
    assert report.rows == [1, size, *GRAMMAR_ROWS]
    assert_no_request_state(llm)
    # The paths ran: penalised rows took token-count rows (the table's first 8), the grammar
    # compiled and its batched matcher exists.
    assert runner.sampler.counts.counts.shape[0] == 8
    assert json.dumps(STRUCTURED, sort_keys=True) in runner.logits_processors._grammars
    assert runner.logits_processors._batch is not None


def test_a_seeded_request_samples_the_same_tokens_after_warm_up(llm):
    pytest.importorskip("xgrammar")
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(
            temperature=0.9, top_p=0.9, top_k=50, min_p=0.02, repetition_penalty=1.2,
            frequency_penalty=0.3, presence_penalty=0.2, seed=11, max_tokens=8, logprobs=3,
            ignore_eos=True,
        ),
        SamplingParams(temperature=0.8, seed=5, max_tokens=8, min_tokens=4, logit_bias={7: 3.0}),
        SamplingParams(temperature=0.9, seed=3, max_tokens=12, structured=STRUCTURED),
    ]  # fmt: skip
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13], [1, 2, 3]]

    def run() -> list[tuple]:
        outs = llm.generate(prompts, params)
        return [(o.token_ids, o.logprobs) for o in outs]

    before = run()
    warm_up(llm.engine.worker, sizes=[len(KINDS) + 1], grammar=True)
    assert run() == before
    assert_no_request_state(llm)


def test_a_speculating_worker_warms_its_verify_step(model_dir):
    spec = LLM(
        model_dir, device="cpu", warmup=False, speculative_method="ngram",
        num_speculative_tokens=2,
    )  # fmt: skip
    report = warm_up(spec.engine.worker, sizes=[3])
    assert report.verify and not report.grammar
    # The plain step, then the verify step: 3 sequences, drafts of 2, 2 and 0 tokens.
    assert report.rows == [3, 3 + 2 + 2]
    assert_no_request_state(spec)


def test_the_worker_calls_warm_up_at_start_unless_told_not_to(model_dir, caplog):
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, EngineConfig)
    assert not engine_config_from_args(parser.parse_args(["--no-warmup"])).warmup
    with caplog.at_level(logging.DEBUG, logger="common.engine.warmup"):
        LLM(model_dir, device="cpu", warmup=False)
        assert not [r for r in caplog.records if r.name == "common.engine.warmup"]
        LLM(model_dir, device="cpu")  # on CPU nothing compiles: the default warms nothing
    assert [r.getMessage() for r in caplog.records if r.name == "common.engine.warmup"] == [
        "warm-up: nothing to warm on cpu"
    ]


def test_warm_up_refuses_sizes_that_are_not_positive_integers(llm):
    with pytest.raises(ValueError, match=r"sizes must be positive integers, got \[4, 0\]"):
        warm_up(llm.engine.worker, sizes=[4, 0])
