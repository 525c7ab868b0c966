"""lm-evaluation-harness against a real PD stack, unchanged: its `local-completions` model scores
the two tasks of benchmarks/lm_eval (a loglikelihood one, which sends `echo: true, logprobs: 1`,
and a generate_until one) on the embedded model, and lm-eval's own `hf` backend on the same
weights in fp32 scores them the same; `local-chat-completions` runs the generate_until task.

scripts/run_tests.sh installs lm-eval with the few packages this path imports
(tests/lm_eval_requirements.txt, ~10 s); a plain pytest without it skips this file. Users install
the whole of it: `pip install -e '.[lmeval]'`.
"""

from __future__ import annotations

import pytest

from benchmarks.lm_eval.compare import (
    GEN,
    GEN_SCORE,
    HF_BATCH_SIZE,
    MC,
    MC_SCORE,
    chat_args,
    completions_args,
    evaluate,
    generations,
    hf_args,
    loglikelihoods,
    offline_env,
    task_manager,
)
from benchmarks.stack import same_python_env
from tests.pd_stack import ROOT, PDStack

pytest.importorskip("lm_eval", reason="lm-eval is not installed: scripts/run_tests.sh installs it")

ROWS = 20  # benchmarks/lm_eval/capitals.jsonl
# Both sides run fp32 with different kernels and summation orders; tests/test_prompt_logprobs_e2e.py
# holds pdserve's prompt logprobs to HF's within the same bound.
LOGLIKELIHOOD_ATOL = 1e-3
ONE_SAMPLE = 1 / ROWS + 1e-9  # a near tie may flip one row's choice or greedy token


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    """lm-eval as a user runs it from the repository root, offline; `lm_eval` is first imported
    here, after the environment datasets reads on import is set."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        for key, value in offline_env(tmp_path_factory.mktemp("datasets")).items():
            mp.setenv(key, value)
        yield task_manager()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    stack = PDStack(log_path=tmp / "launch.log", env=same_python_env(tmp / "venv"))
    yield stack
    assert stack.stop() == [], "processes left after Ctrl-C"


@pytest.fixture(scope="module")
def pdserve_out(manager, stack, smollm_dir) -> dict:
    return evaluate(
        "local-completions", completions_args(stack.url, smollm_dir), [MC, GEN], manager
    )


@pytest.fixture(scope="module")
def hf_out(manager, smollm_dir) -> dict:
    return evaluate("hf", hf_args(smollm_dir), [MC, GEN], manager, batch_size=HF_BATCH_SIZE)


def test_loglikelihood_task_scores_as_lm_eval_hf_on_the_same_weights(pdserve_out, hf_out):
    ours, theirs = loglikelihoods(pdserve_out), loglikelihoods(hf_out)
    assert len(ours) == len(theirs) == ROWS and all(len(row) == 4 for row in ours)
    for row, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a == pytest.approx(b, abs=LOGLIKELIHOOD_ATOL), f"row {row}"
    acc = pdserve_out["results"][MC][MC_SCORE]
    assert acc == pytest.approx(hf_out["results"][MC][MC_SCORE], abs=ONE_SAMPLE)
    assert acc >= 0.5  # the model knows most capitals: 4-way chance is 0.25


def test_generate_until_task_scores_as_lm_eval_hf_on_the_same_weights(pdserve_out, hf_out):
    ours, theirs = generations(pdserve_out), generations(hf_out)
    assert len(ours) == len(theirs) == ROWS
    differing = [(a, b) for a, b in zip(ours, theirs, strict=True) if a != b]
    assert len(differing) <= 1, differing
    match = pdserve_out["results"][GEN][GEN_SCORE]
    assert match == pytest.approx(hf_out["results"][GEN][GEN_SCORE], abs=ONE_SAMPLE)
    assert match >= 0.5


def test_local_chat_completions_runs_the_generate_until_task(manager, stack):
    out = evaluate(
        "local-chat-completions", chat_args(stack.url), [GEN], manager, apply_chat_template=True
    )
    answers = generations(out)
    assert len(answers) == ROWS and all(isinstance(a, str) for a in answers)
    assert any(answers), "every chat answer was empty"
    assert 0.0 <= out["results"][GEN][GEN_SCORE] <= 1.0
