"""Speculative decoding's counts travel from the sequence to the client and to /metrics: a
speculating decode node puts each sample's `SpecStats` on its finishing `TokenBatch` row
(validated on receipt like every column), the router adds them to the request's `timing`
record (`spec_decode`) and counts them under vLLM's `spec_decode` names.

Router: the real FastAPI app with loopback nodes (tests/router_fakes.py). Node: a real
colocated `DecodeNode` on a tiny random Qwen2, whose sequence's counts the test sets (the
engine's verify step is what records them in service).
"""
# ruff: noqa: F811  (the `make` and `answer_ids` fixtures imported from test_router_api_generation are re-bound as arguments)

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from common.engine.config import EngineConfig
from common.engine.llm import LLM
from common.engine.spec_decode.stats import SpecStats
from common.node.config import NodeConfig
from common.protocol.messages import (
    DecodeRequest,
    MessageError,
    TokenBatch,
    decode,
    encode,
)
from common.protocol.sampling_params import SamplingParams
from decode_node.node import DecodeNode
from router.timing import TimingMarks, assemble
from tests.node_harness import MAX_STEPS, drain, engine_config, pull, save_tiny_model
from tests.router_fakes import Script, generation_script, metric
from tests.test_router_api_generation import CHAT, HI, TEXT, answer_ids, make, post  # noqa: F401

# 3 verify steps: 4 drafted of which 3 kept, 4 of which 0, 2 of which 2
COUNTS = {
    "num_drafts": 3,
    "num_draft_tokens": 10,
    "num_accepted_tokens": 5,
    "mean_accepted_length": 2.6667,
    "accepted_per_position": [2, 2, 1],
}


def batch(counts: dict[str, Any] | None, reasons=(None, "stop")) -> TokenBatch:
    return TokenBatch(["r", "r"], [5, 6], list(reasons), spec_decode=[None, counts])


# -- the wire ------------------------------------------------------------------------------------


def test_a_finishing_rows_counts_survive_the_wire_and_reach_only_that_output():
    received = decode(encode(batch(COUNTS)))
    assert received.spec_decode == [None, COUNTS]
    first, last = received.items()
    assert first.spec_decode is None and last.spec_decode == COUNTS and last.finished
    assert decode(encode(TokenBatch(["r"], [5], ["stop"]))).spec_decode is None


@pytest.mark.parametrize(
    "counts, complaint",
    [
        ({**COUNTS, "num_drafts": -1}, "ints >= 0"),
        ({**COUNTS, "num_draft_tokens": 4.0}, "ints >= 0"),
        ({**COUNTS, "num_accepted_tokens": True}, "ints >= 0"),
        ({k: v for k, v in COUNTS.items() if k != "num_drafts"}, "missing ['num_drafts']"),
        ({**COUNTS, "rate": 0.5}, "unknown ['rate']"),
        (
            {**COUNTS, "num_accepted_tokens": 11, "accepted_per_position": [3, 3, 3, 2]},
            "11 accepted of 10 drafted",
        ),  # fmt: skip
        ({**COUNTS, "accepted_per_position": [2, 2]}, "does not fit 5 accepted"),
        ({**COUNTS, "accepted_per_position": [5]}, "does not fit 5 accepted tokens in 3 drafts"),
        ({**COUNTS, "accepted_per_position": "2,2,1"}, "not a list"),
        ({**COUNTS, "mean_accepted_length": "2.7"}, "not a number"),
    ],
)
def test_inconsistent_counts_are_refused_on_receipt_naming_the_values(counts, complaint):
    with pytest.raises(MessageError, match=complaint.replace("[", r"\[")):
        decode(encode(batch(counts)))


def test_counts_only_ride_a_finishing_row_and_the_column_has_one_entry_per_row():
    with pytest.raises(MessageError, match="row 1: spec_decode on a row that goes on"):
        batch(COUNTS, reasons=(None, None))
    with pytest.raises(MessageError, match="columns differ in length"):
        TokenBatch(["r"], [5], ["stop"], spec_decode=[None, COUNTS])


# -- the router ----------------------------------------------------------------------------------


def speculating(script: Script, counts: dict[str, Any]) -> Script:
    """`script`'s events, its finishing TokenBatch carrying `counts`."""

    def run(node_id: str, message: Any) -> list[Any]:
        events = script(node_id, message)
        if events and isinstance(events[-1], TokenBatch):
            events[-1] = dataclasses.replace(events[-1], spec_decode=[counts])
        return events

    return run


def test_the_timing_record_and_metrics_carry_the_counts_of_a_speculating_request(make, answer_ids):
    app, core, _ = make(speculating(generation_script(answer_ids), COUNTS))
    body = post(app, CHAT, {"model": "smol", "messages": HI, "max_tokens": 50}).json()
    assert body["timing"]["spec_decode"] == {
        "num_drafts": 3,
        "num_draft_tokens": 10,
        "num_accepted_tokens": 5,
        "mean_accepted_length": 2.6667,
    }
    post(app, TEXT, {"prompt": "x", "max_tokens": 50, "stream": True})
    text = core.metrics.render()
    model = {"model_name": "smol"}
    assert metric(text, "pdserve:spec_decode_num_drafts_total", **model) == 6
    assert metric(text, "pdserve:spec_decode_num_draft_tokens_total", **model) == 20
    assert metric(text, "pdserve:spec_decode_num_accepted_tokens_total", **model) == 10
    per_pos = "pdserve:spec_decode_num_accepted_tokens_per_pos_total"
    assert [metric(text, per_pos, position=str(j), **model) for j in range(4)] == [
        4, 4, 2, None,
    ]  # fmt: skip


def test_a_request_without_speculation_has_no_spec_decode_entry(make, answer_ids):
    app, core, _ = make(generation_script(answer_ids))
    body = post(app, CHAT, {"model": "smol", "messages": HI, "max_tokens": 50}).json()
    assert "spec_decode" not in body["timing"] and body["timing"]["e2e"] is not None
    assert metric(core.metrics.render(), "pdserve:spec_decode_num_drafts_total") is None


def test_the_samples_of_a_request_add_up_in_its_record():
    marks = TimingMarks(arrival=1.0)
    marks.add_spec_decode(COUNTS)
    marks.add_spec_decode({**COUNTS, "num_drafts": 1, "num_draft_tokens": 4,
                           "num_accepted_tokens": 4, "accepted_per_position": [1, 1, 1, 1]})  # fmt: skip
    record = assemble(marks, 2.0)
    assert record.spec_decode == SpecStats(4, 14, 9, [3, 3, 2, 1])
    assert record.to_dict()["spec_decode"]["mean_accepted_length"] == 3.25


# -- a real decode node ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("spec-metrics-qwen2"))


def colocated_node(engine: EngineConfig, tmp_path) -> tuple[DecodeNode, Any]:
    router_address = f"ipc://{tmp_path}/router"
    router = pull(router_address)
    config = NodeConfig(
        control_address=f"ipc://{tmp_path}/colocated", router_address=router_address,
        kv_address="tcp://127.0.0.1:0", colocated=True,
    )  # fmt: skip
    return DecodeNode(config, engine), router


def run_one(node: DecodeNode, router, on_step=lambda seq: None) -> list[TokenBatch]:
    sampling = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    node.handle(DecodeRequest("r", list(range(10, 50)), sampling, None))
    seq = node.requests["r"].seq
    heard: list[Any] = []
    for _ in range(MAX_STEPS):
        node.step()
        on_step(seq)
        heard += drain(router)
        if not node.requests:
            break

    def finished() -> bool:
        return any(isinstance(m, TokenBatch) and any(m.finish_reasons) for m in heard)

    # The finishing row may still be in flight on the socket when the node is done with it.
    while not finished() and router.poll(10_000):
        heard += drain(router)
    return [m for m in heard if isinstance(m, TokenBatch)]


def test_a_speculating_nodes_finishing_row_carries_its_sequences_counts(model_dir, tmp_path):
    base = engine_config(model_dir)
    engine = dataclasses.replace(
        base, speculative=dataclasses.replace(base.speculative, speculative_method="ngram")
    )
    node, router = colocated_node(engine, tmp_path)
    recorded: list[SpecStats] = []

    def verify_steps(seq) -> None:  # what the engine's verify steps record, set by hand here
        if len(seq.output_token_ids) == 2 and not recorded:
            seq.spec.record(3, 2)
            seq.spec.record(3, 0)
            recorded.append(seq.spec)

    try:
        batches = run_one(node, router, verify_steps)
        rows = [
            (b.finish_reasons[i], (b.spec_decode or [None] * len(b.request_ids))[i])
            for b in batches
            for i in range(len(b.request_ids))
        ]
        assert sum(1 for reason, _ in rows if reason is not None) == 1
        (spec,) = recorded
        assert spec.num_drafts >= 2  # the engine may have drafted too
        expected = {**spec.to_dict(), "accepted_per_position": spec.accepted_per_position}
        assert rows[-1] == ("length", expected)
        assert all(counts is None for _, counts in rows[:-1])
    finally:
        node.close()
        node.channel.close()
        router.close(linger=0)


def test_a_node_that_does_not_speculate_sends_no_counts(model_dir, tmp_path):
    node, router = colocated_node(engine_config(model_dir), tmp_path)
    try:
        batches = run_one(node, router)
        assert batches and batches[-1].finish_reasons[-1] == "length"
        assert all(b.spec_decode is None for b in batches)
    finally:
        node.close()
        node.channel.close()
        router.close(linger=0)


def test_the_offline_llm_reports_each_requests_counts_when_it_speculates(model_dir):
    sampling = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = list(range(10, 30)) * 2  # repeats: something for prompt lookup to find
    with LLM(model_dir, device="cpu", dtype="float32", enforce_eager=True) as plain:
        (out,) = plain.generate(prompt, sampling)
        assert out.spec_decode is None
    with LLM(model_dir, device="cpu", dtype="float32", enforce_eager=True,
             speculative_method="ngram") as llm:  # fmt: skip
        (out,) = llm.generate(prompt, sampling)
    counts = out.spec_decode
    assert len(out.token_ids) == 6 and counts is not None
    assert set(counts) == {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
                           "mean_accepted_length"}  # fmt: skip
    drafts, accepted = counts["num_drafts"], counts["num_accepted_tokens"]
    assert counts["mean_accepted_length"] == pytest.approx(
        1 + accepted / drafts if drafts else 1.0, abs=1e-4
    )
