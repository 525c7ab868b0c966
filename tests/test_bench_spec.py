"""The speculative-decoding GPU benchmark's code paths on CPU (`benchmarks/bench_spec.py
--smoke`): the oracle controls the mean accepted length while the engine emits exactly the
tokens of the run without speculation; the verify, draft-model and EAGLE-3 parts run through
the real engine and the report judges the targets only at the acceptance they are set at."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks import bench_spec
from benchmarks import spec_models as sm
from benchmarks.spec_harness import context_free
from benchmarks.spec_oracle import (
    FixedDraftProposer,
    OracleProposer,
    alpha_for_mean,
    expected_run,
)
from benchmarks.spec_report import oracle_verdict, tables
from common import LLM, SamplingParams
from common.engine.scheduler import ScheduledBatch, ScheduledSeq
from common.engine.sequence import Sequence

VOCAB = 512


def decoding(request_id: str, output: list[int]) -> ScheduledSeq:
    seq = Sequence(request_id, [7, 8, 9], SamplingParams(temperature=0.0))
    seq.output_token_ids = list(output)
    return ScheduledSeq(seq, seq.num_tokens - 1, 1)


@pytest.mark.parametrize("k", [2, 3, 4, 5, 7])
def test_alpha_gives_the_asked_mean_accepted_length(k):
    alpha = alpha_for_mean(3.0, k)
    assert 1 + expected_run(alpha, k) == pytest.approx(3.0, abs=1e-9)
    assert alpha_for_mean(1.0, k) == pytest.approx(0.0, abs=1e-9)
    assert alpha_for_mean(k + 1.0, k) == 1.0


def test_a_mean_accepted_length_past_k_plus_one_is_refused():
    with pytest.raises(ValueError, match="mean accepted length 4.5 is outside \\[1, 4\\] for K=3"):
        alpha_for_mean(4.5, 3)


def test_oracle_drafts_a_true_run_then_wrong_tokens_at_the_asked_mean():
    rng = random.Random(1)
    ref = [rng.randrange(VOCAB) for _ in range(4000)]
    oracle = OracleProposer({"a": ref}, 3.0, 4, VOCAB, seed=0)
    runs = []
    for n in range(1, 3900, 2):
        drafts = oracle.propose(ScheduledBatch([decoding("a", ref[:n])]), [4]).token_ids[0]
        assert len(drafts) == 4
        # Accepted: the drafts up to the first that differs from the reference.
        runs.append(
            next((j for j, (d, t) in enumerate(zip(drafts, ref[n:], strict=False)) if d != t), 4)
        )
    assert 1 + sum(runs) / len(runs) == pytest.approx(3.0, abs=0.08)
    assert set(runs) == {0, 1, 2, 3, 4}, "runs of every length, as real acceptances run"
    assert oracle.off_track == set()


def test_oracle_drafts_only_wrong_tokens_once_a_sequence_leaves_its_reference():
    ref = list(range(10, 60))
    oracle = OracleProposer({"a": ref}, 5.0, 4, VOCAB, seed=0)  # alpha 1: every draft right
    assert oracle.propose(ScheduledBatch([decoding("a", ref[:5])]), [4]).token_ids == [ref[5:9]]
    strayed = ref[:5] + [3]
    drafts = oracle.propose(ScheduledBatch([decoding("a", strayed)]), [4]).token_ids[0]
    assert drafts == [4, 4, 4, 4] and oracle.off_track == {"a"}
    back = oracle.propose(ScheduledBatch([decoding("a", ref[:7])]), [3]).token_ids[0]
    assert back == [ref[6] + 1] * 3, "a sequence that strayed once stays off track"


def test_fixed_proposer_drafts_each_limit_inside_the_vocabulary():
    items = [decoding("a", [VOCAB - 1]), decoding("b", [5]), decoding("c", [6])]
    drafts = FixedDraftProposer(VOCAB).propose(ScheduledBatch(items), [3, 0, 5]).token_ids
    assert [len(d) for d in drafts] == [3, 0, 5]
    assert drafts[0] == [0, 1, 2] and drafts[2] == [7, 8, 9, 10, 11]


def test_context_free_logits_depend_on_the_last_token_only_and_weights_come_back(tmp_path):
    llm = LLM(str(sm.write_config(tmp_path / "t", sm.TINY_QWEN_TARGET)), load_format="dummy",
              device="cpu", max_num_seqs=4, kv_cache_memory_bytes=16 << 20)  # fmt: skip
    model = llm.engine.worker.model
    before = [p.clone() for p in model.parameters()]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[11, 12, 13, 40], [200, 300, 40], [40]]
    with context_free(model):
        outs = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[0] == outs[1] == outs[2]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert len({tuple(o.token_ids) for o in llm.generate(prompts, params)}) > 1


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("bench_spec")
    qwen = bench_spec.main(
        ["--smoke", "--parts", "oracle", "verify", "draft", "sweep",
         "--output-range", "48", "64", "--out", str(out / "q.json")]
    )  # fmt: skip
    llama = bench_spec.main(["--smoke", "--parts", "eagle3", "--out", str(out / "l.json")])
    return qwen, llama


def test_oracle_run_emits_the_off_tokens_at_the_asked_acceptance(smoke):
    qwen, _ = smoke
    assert qwen["errors"] == {}
    rows = qwen["oracle"]
    assert {(r["batch"], r["k"]) for r in rows} == {(1, 4), (3, 4), (1, 2), (3, 2)}
    for r in rows:
        assert r["identical_outputs"] == r["requests"] and r["off_track"] == 0
        assert r["mean_accepted_length"] == pytest.approx(3.0, abs=0.4)
        assert r["output_tokens"] >= 48 * r["requests"]


def test_verify_part_times_every_batch_and_k_against_plain_steps(smoke):
    qwen, _ = smoke
    points = {(r["batch"], r["k"], r["loop"]) for r in qwen["verify"]}
    expected = {(b, 0, loop) for b in (1, 3) for loop in ("overlap", "sync")}
    expected |= {(b, k, "sync") for b in (1, 3) for k in (1, 2)}
    assert points == expected
    for r in qwen["verify"]:
        assert r["step_s"] > 0 and r["mean_context"] >= 24
        # Random drafts: nearly every step emits one token per sequence.
        assert 1.0 <= r["tokens_per_step"] < 1.5


@pytest.mark.parametrize("method", ["draft", "eagle3"])
def test_draft_methods_report_propose_time_throughput_and_catch_up(smoke, method):
    result = smoke[0] if method == "draft" else smoke[1]
    assert result["errors"] == {}
    rows = [r for r in result["methods"] if r["method"] == method]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert 0 < r["propose_s"] < r["step_s"] and r["on_tokens_per_s"] > 0
    (catchup,) = result["catchup"]
    assert catchup["method"] == method and catchup["prompt_tokens"] == 40
    assert catchup["target_prefill_s"] > 0 and catchup["first_propose_s"] > 0


def test_report_prints_every_table(smoke):
    text = tables(list(smoke))
    for heading in ("oracle drafts", "verify step ms", "draft methods", "catch-up"):
        assert heading in text
    assert "FAILED" not in text


def test_report_judges_the_targets_only_at_the_asked_acceptance():
    row = {"batch": 1, "k": 4, "target_mean_accepted_length": 3.0, "mean_accepted_length": 3.05}
    assert oracle_verdict({**row, "speedup": 2.3}) == "PASS (>= 2.2)"
    assert oracle_verdict({**row, "speedup": 1.98}) == "MISS by 10.0% (>= 2.2)"
    assert oracle_verdict({**row, "batch": 32, "speedup": 1.7}) == "PASS (>= 1.6)"
    assert oracle_verdict({**row, "mean_accepted_length": 2.5, "speedup": 3.0}).startswith(
        "no verdict"
    )
    assert oracle_verdict({**row, "batch": 8, "speedup": 3.0}) == "-"
    assert oracle_verdict({**row, "k": 2, "speedup": 3.0}) == "-"
