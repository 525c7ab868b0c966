"""The serving benchmark against the real embedded-model stack (launch_pd.sh, HTTP, SSE): a
Poisson run, the CLI with a JSONL trace that holds a request the server refuses, vLLM's
request shapes, the early stop that frees every block, and a two-layout sweep."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_serving, sweep_layouts
from benchmarks.loadgen.client import Target
from benchmarks.loadgen.metrics import SLO
from benchmarks.loadgen.runner import RunConfig, StopRule, run
from benchmarks.loadgen.workloads import RequestSpec, WorkloadConfig, build_workload
from benchmarks.sweep_probe import StackProbe
from tests.pd_stack import PDStack

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = PDStack(log_path=tmp_path_factory.mktemp("bench") / "launch.log")
    yield s
    assert s.stop() == []


def small_workload(num: int, seed: int = 0) -> list[RequestSpec]:
    return build_workload(WorkloadConfig("random", num, seed, input_len="16:48", output_len="3:6"))


def test_a_poisson_run_counts_every_token_and_the_server_phases(stack):
    specs = small_workload(6)
    out = bench_serving.benchmark(
        Target(stack.url, MODEL), specs, RunConfig(request_rate=4.0, seed=1, progress=False)
    )
    summary = out["summary"]
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_output_tokens"] == sum(s.output_len for s in specs)  # ignore_eos
    for spec, row in zip(specs, out["requests"], strict=True):
        assert row["output_tokens"] == spec.output_len  # from the usage chunk
        # An ITL gap per chunk after the first: a chunk per token while the router keeps up,
        # fewer when it falls behind and sends what queued up as one (as vLLM's server does).
        assert len(row["itl"]) <= spec.output_len - 1
        assert row["prompt_tokens"] == spec.prompt_len
    phases = out["server_phases"]
    for phase in ("prefill_compute", "kv_transfer", "router_queue_tokenize", "ttft"):
        assert phases[phase]["count"] == 6
    assert phases["client_minus_server_ttft"]["p50"] >= 0
    sent = [row["sent"] for row in out["requests"]]
    assert sent == sorted(sent) and sent[-1] > 0  # spread over time, not all at once


def test_the_cli_reads_a_jsonl_trace_counts_a_refused_request_and_writes_json_and_png(
    stack, tmp_path
):
    trace = tmp_path / "trace.jsonl"
    rows = [{"prompt": "The capital of France is", "output_len": 3}] * 2
    rows.append({"prompt_token_ids": [1000] * 9000, "output_len": 2})  # over the context
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = bench_serving.main(
        [
            "--base-url", stack.url, "--dataset-path", str(trace), "--num-prompts", "3",
            "--request-rate", "inf", "--goodput", "ttft:600000", "--result-dir",
            str(tmp_path), "--label", "trace", "--no-progress",
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads((tmp_path / "trace.json").read_text())
    summary = result["summary"]
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["errors"] == {"HTTP 400": 1}
    assert summary["attainment"] == pytest.approx(2 / 3)
    assert (tmp_path / "trace.png").stat().st_size > 10_000
    assert result["model"] == MODEL


@pytest.mark.parametrize(
    "endpoint, spec",
    [
        ("completions", RequestSpec(3, prompt_token_ids=(504, 3575, 282, 4649, 314))),
        ("completions", RequestSpec(3, prompt="The capital of France is")),
        ("chat", RequestSpec(3, prompt="What is the capital of France?")),
    ],
)
def test_vllm_bench_serve_request_shapes_are_served(stack, endpoint, spec):
    target = Target(stack.url, MODEL, endpoint=endpoint, temperature=None, ignore_eos=False)
    outcome = run(target, [spec], RunConfig(progress=False))
    (r,) = outcome.results
    assert r.success, r.error
    assert r.status == 200 and 1 <= r.output_tokens <= 3 and r.prompt_tokens >= 5
    assert len(r.itl) <= r.output_tokens - 1  # a gap per chunk; queued tokens share one


def test_a_point_that_cannot_meet_its_slo_stops_early_and_the_nodes_free_every_block(stack):
    specs = small_workload(12, seed=3)
    slo = SLO.parse(["ttft:1"])  # 1 ms: every request misses
    config = RunConfig(
        request_rate=3.0, seed=3, stop_when_missed=StopRule.for_attainment(slo, 0.9, 12),
        progress=False,
    )  # fmt: skip
    out = bench_serving.benchmark(Target(stack.url, MODEL), specs, config, slo)
    assert out["stopped_early"]
    assert out["summary"]["good_requests"] == 0
    errors = out["summary"]["errors"]
    assert errors.get("not sent", 0) >= 1  # later arrivals never left
    held = StackProbe(stack).wait_idle(timeout_s=60)
    assert all(v == 0 for node in held.values() for v in node.values()), held


def test_client_processes_share_one_schedule(stack):
    specs = small_workload(4, seed=5)
    config = RunConfig(request_rate=8.0, seed=5, client_processes=2, progress=False)
    out = bench_serving.benchmark(Target(stack.url, MODEL), specs, config)
    assert out["summary"]["completed"] == 4
    assert [r["index"] for r in out["requests"]] == [0, 1, 2, 3]
    assert out["summary"]["send_lag_ms"]["p99"] < 60_000  # every request got a send time


def test_a_sweep_runs_each_layout_through_the_launcher_and_writes_its_figure(tmp_path):
    code = sweep_layouts.main(
        [
            "--layouts", "1p1d", "1c", "--transport", "zmq", "--dataset", "random",
            "--input-len", "16:32", "--output-len", "2:4", "--slo", "ttft:600000",
            "--rates-per-gpu", "1", "--duration", "2", "--warmup-requests", "1",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads((tmp_path / "sweep.json").read_text())
    assert [x["layout"] for x in result["layouts"]] == ["1p1d", "1c"]
    for layout in result["layouts"]:
        assert layout["orphans"] == []
        (point,) = layout["points"]
        assert point["summary"]["failed"] == 0 and point["attainment"] == 1.0
        held = point["held_blocks_after"]
        assert held and all(v == 0 for node in held.values() for v in node.values())
        assert any(name.startswith("router") for name in point["cpu_percent"])
        assert layout["max_goodput"]["bound"] == "lower"
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
