"""The serving benchmark's arithmetic and workloads, without a server: percentiles, TPOT,
goodput and attainment on known timestamps, arrival schedules, length specs, datasets,
JSONL traces, the request shapes it sends, and the sweep's layout and knee arithmetic."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from benchmarks.loadgen.client import RequestResult, Target
from benchmarks.loadgen.metrics import SLO, percentile, server_phases, summarize
from benchmarks.loadgen.runner import RunConfig, StopRule, arrival_offsets
from benchmarks.loadgen.workloads import (
    RequestSpec,
    WorkloadConfig,
    build_workload,
    parse_length,
    read_jsonl,
)
from benchmarks.sweep_layouts import Layout, max_goodput_rate


def done(index: int, ttft: float, e2e: float, tokens: int, **kw) -> RequestResult:
    itl = [(e2e - ttft) / (tokens - 1)] * (tokens - 1) if tokens > 1 else []
    return RequestResult(
        index, 0.0, sent=0.0, ttft=ttft, e2e=e2e, itl=itl, output_tokens=tokens,
        prompt_tokens=10, success=True, **kw,
    )  # fmt: skip


def gaps_of(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times[:-1], times[1:], strict=True)]


def test_percentiles_interpolate_between_ranks_like_numpy():
    values = list(range(1, 101))  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 90) == 3.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_tpot_is_the_time_after_the_first_token_over_the_tokens_after_it():
    r = done(0, ttft=0.2, e2e=1.2, tokens=11)
    assert r.tpot == pytest.approx(0.1)
    assert done(1, ttft=0.2, e2e=0.2, tokens=1).tpot is None  # one token: no TPOT


def test_goodput_counts_completed_requests_within_every_slo_per_second():
    results = [
        done(0, ttft=0.1, e2e=1.1, tokens=11),  # TPOT 100 ms: good
        done(1, ttft=0.6, e2e=1.6, tokens=11),  # TTFT over 500 ms
        done(2, ttft=0.1, e2e=3.1, tokens=11),  # TPOT 300 ms: over 200 ms
        done(3, ttft=0.3, e2e=0.3, tokens=1),  # one token: TPOT not constrained, good
        RequestResult(4, 0.0, sent=0.0, error="HTTP 503: no healthy node", status=503),
    ]
    slo = SLO.parse(["ttft:500", "tpot:200"])
    summary = summarize(results, duration_s=4.0, slo=slo)
    assert summary["completed"] == 4 and summary["failed"] == 1
    assert summary["errors"] == {"HTTP 503": 1}
    assert summary["good_requests"] == 2
    assert summary["goodput"] == pytest.approx(2 / 4.0)
    assert summary["attainment"] == pytest.approx(2 / 5)  # failures count as misses
    assert summary["slo_misses"] == {"ttft": 1, "tpot": 1, "e2el": 0}
    assert summary["request_throughput"] == pytest.approx(4 / 4.0)
    assert summary["total_output_tokens"] == 34
    assert summary["ttft_ms"]["p50"] == pytest.approx(200.0)  # median of 100, 600, 100, 300


def test_e2e_latency_slo_and_a_failed_request_are_never_good():
    slo = SLO.parse(["e2el:1000"])
    assert slo.met(done(0, ttft=0.1, e2e=0.9, tokens=5))
    assert not slo.met(done(1, ttft=0.1, e2e=1.1, tokens=5))
    assert not slo.met(RequestResult(2, 0.0, error="cancelled"))


@pytest.mark.parametrize("bad", ["ttft", "latency:100", "tpot:abc", "ttft:0", "tpot:-5"])
def test_bad_slos_are_refused_with_their_text(bad):
    with pytest.raises(ValueError, match="bad SLO"):
        SLO.parse([bad])


def test_server_phases_take_percentiles_of_every_scalar_phase_and_the_client_gap():
    rows = [done(i, ttft=0.1 + i / 100, e2e=1.0, tokens=5) for i in range(3)]
    for i, r in enumerate(rows):
        r.timing = {"ttft": 0.09 + i / 100, "prefill_compute": 0.05, "kv_transfer": None,
                    "decode_intervals": {"p99": 0.02}}  # fmt: skip
    phases = server_phases(rows)
    assert phases["prefill_compute"]["p50"] == pytest.approx(50.0)
    assert phases["client_minus_server_ttft"]["p50"] == pytest.approx(10.0)
    assert phases["decode_interval_p99"]["count"] == 3
    assert "kv_transfer" not in phases  # null: not measured


def test_poisson_schedule_is_fixed_by_the_seed_and_has_the_asked_rate():
    a = arrival_offsets(20000, rate=5.0, burstiness=1.0, seed=3)
    assert a == arrival_offsets(20000, rate=5.0, burstiness=1.0, seed=3)
    assert a != arrival_offsets(20000, rate=5.0, burstiness=1.0, seed=4)
    gaps = gaps_of(a)
    assert a[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 5.0, rel=0.03)
    cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2
    assert cv2 == pytest.approx(1.0, rel=0.06)  # exponential gaps


def test_burstiness_below_one_spreads_the_gaps_and_keeps_the_rate():
    gaps = gaps_of(arrival_offsets(20000, 5.0, 0.25, 1))
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.05)
    cv2 = statistics.pvariance(gaps) / statistics.fmean(gaps) ** 2
    assert cv2 == pytest.approx(4.0, rel=0.1)  # gamma(k): CV^2 = 1 / k


def test_an_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(4, math.inf, 1.0, 0) == [0.0] * 4


def test_the_stop_rule_allows_the_misses_the_attainment_leaves():
    slo = SLO.parse(["ttft:100"])
    assert StopRule.for_attainment(slo, 0.9, 100).allowed_misses == 10
    assert StopRule.for_attainment(slo, 0.9, 9).allowed_misses == 0
    assert StopRule.for_attainment(slo, 1.0, 50).allowed_misses == 0
    with pytest.raises(ValueError):
        StopRule.for_attainment(slo, 0.0, 10)


@pytest.mark.parametrize(
    "kwargs",
    [{"request_rate": 0}, {"burstiness": 0}, {"max_concurrency": 0}, {"client_processes": 0}],
)
def test_run_config_refuses_nonsense(kwargs):
    with pytest.raises(ValueError):
        RunConfig(**kwargs)


def test_length_specs_fixed_uniform_and_clipped_lognormal():
    import random

    rng = random.Random(0)
    assert {parse_length("7")(rng) for _ in range(5)} == {7}
    uniform = [parse_length("3:5")(rng) for _ in range(200)]
    assert set(uniform) == {3, 4, 5}
    heavy = [parse_length("lognormal:100:1.0:10:400")(rng) for _ in range(2000)]
    assert min(heavy) >= 10 and max(heavy) <= 400
    assert statistics.median(heavy) == pytest.approx(100, rel=0.1)
    for bad in ("0", "5:3", "x", "lognormal:100:1", "lognormal:-1:1:1:2", "normal:1:1:1:1"):
        with pytest.raises(ValueError, match="bad length spec"):
            parse_length(bad)


def test_long_prompt_and_chat_datasets_draw_their_lengths_deterministically():
    long = build_workload(WorkloadConfig("long-prompt", num_prompts=200, seed=1))
    assert long == build_workload(WorkloadConfig("long-prompt", num_prompts=200, seed=1))
    assert all(2048 <= s.prompt_len <= 8192 and 128 <= s.output_len <= 512 for s in long)
    assert all(1000 <= t < 30000 for s in long[:5] for t in s.prompt_token_ids)
    chat = build_workload(WorkloadConfig("chat", num_prompts=500, seed=1, text=True))
    assert all(s.prompt is not None and 16 <= s.prompt_len <= 4096 for s in chat)
    lengths = sorted(s.prompt_len for s in chat)
    assert lengths[-5] > 4 * statistics.median(lengths)  # a heavy tail


def test_shared_prefix_requests_share_their_groups_system_prompt():
    specs = build_workload(
        WorkloadConfig("shared-prefix", num_prompts=40, num_groups=3, prefix_len=64, seed=2)
    )
    by_group: dict[int, set[tuple[int, ...]]] = {}
    for s in specs:
        by_group.setdefault(s.group, set()).add(s.prompt_token_ids[:64])
    assert set(by_group) == {0, 1, 2}
    assert all(len(prefixes) == 1 for prefixes in by_group.values())
    assert len({next(iter(p)) for p in by_group.values()}) == 3
    assert len({s.prompt_token_ids for s in specs}) == 40  # each question its own


def test_a_jsonl_trace_is_read_and_a_bad_line_is_named(tmp_path):
    good = tmp_path / "trace.jsonl"
    good.write_text(
        json.dumps({"prompt": "Hello there", "output_len": 4}) + "\n\n"
        + json.dumps({"prompt_token_ids": [1, 2, 3], "output_len": 2}) + "\n"
    )  # fmt: skip
    specs = read_jsonl(good)
    assert specs == [
        RequestSpec(4, prompt="Hello there"),
        RequestSpec(2, prompt_token_ids=(1, 2, 3)),
    ]
    cycled = build_workload(WorkloadConfig(num_prompts=5, dataset_path=str(good)))
    assert [s.output_len for s in cycled] == [4, 2, 4, 2, 4]
    for line, message in (
        ("not json", "not JSON"),
        ('{"prompt": "x"}', "output_len"),
        ('{"prompt": "x", "prompt_token_ids": [1], "output_len": 1}', "exactly one"),
        ('{"prompt_token_ids": [1, -2], "output_len": 1}', "prompt_token_ids"),
    ):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"prompt": "ok", "output_len": 1}) + "\n" + line + "\n")
        with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{message}"):
            read_jsonl(bad)


def test_requests_are_shaped_as_vllm_bench_serve_shapes_them():
    spec_ids = RequestSpec(8, prompt_token_ids=(5, 6, 7))
    body = Target("http://x", "m", ignore_eos=False, temperature=None).body(spec_ids)
    assert body == {
        "model": "m", "prompt": [5, 6, 7], "repetition_penalty": 1.0, "max_tokens": 8,
        "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    chat = Target("http://x", "m", endpoint="chat", temperature=None, ignore_eos=False)
    assert chat.body(RequestSpec(3, prompt="hi")) == {
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    with pytest.raises(ValueError, match="text prompts"):
        chat.body(spec_ids)


def test_layouts_parse_and_take_their_gpus_in_order():
    pd = Layout.parse("3P1D")
    assert (pd.prefill, pd.decode, pd.gpus, pd.colocated) == (3, 1, 4, False)
    assert pd.launch_args([4, 5, 6, 7], "cuda_ipc") == [
        "--num-prefill", "3", "--num-decode", "1", "--transport", "cuda_ipc",
        "--prefill-gpus", "4,5,6", "--decode-gpus", "7",
    ]  # fmt: skip
    colo = Layout.parse("2c")
    assert colo.launch_args([0, 1], "cuda_ipc") == [
        "--colocated", "--num-decode", "2", "--decode-gpus", "0,1",
    ]  # fmt: skip
    assert colo.launch_args([], "zmq") == ["--colocated", "--num-decode", "2"]  # CPU
    with pytest.raises(ValueError, match="needs 4 GPUs"):
        pd.launch_args([0, 1], "cuda_ipc")
    for bad in ("0p1d", "1p0d", "0c", "2x2"):
        with pytest.raises(ValueError):
            Layout.parse(bad)


def test_max_goodput_rate_interpolates_the_attainment_crossing():
    points = [
        {"rate": 2.0, "attainment": 1.0},
        {"rate": 4.0, "attainment": 0.95},
        {"rate": 6.0, "attainment": 0.75},
    ]
    assert max_goodput_rate(points, 0.9) == {"rate": pytest.approx(4.5), "bound": "interpolated"}
    assert max_goodput_rate(points[:2], 0.9) == {"rate": 4.0, "bound": "lower"}
    assert max_goodput_rate(points[2:], 0.9) == {"rate": 0.0, "bound": "none"}


def test_a_sweep_rescored_under_a_tighter_slo_finds_an_earlier_knee():
    from benchmarks.sweep_layouts import rescore

    def rows(tpots_ms: list[float]) -> list[dict]:
        return [
            {"sent": 0.0, "ttft": 0.1, "tpot": t / 1000, "e2e": 0.1 + 9 * t / 1000,
             "output_tokens": 10, "success": True, "error": None}
            for t in tpots_ms
        ]  # fmt: skip

    layout = {
        "gpus": 2,
        "points": [
            {"rate": 2.0, "requests": rows([10] * 10)},
            {"rate": 4.0, "requests": rows([10] * 5 + [30] * 5)},
            {"rate": 6.0, "requests": rows([45] * 10)},
        ],
    }
    loose = rescore(layout, SLO.parse(["tpot:50"]), 0.9)
    assert loose == {"rate": 6.0, "bound": "lower", "per_gpu": 3.0}
    tight = rescore(layout, SLO.parse(["tpot:20"]), 0.9)
    assert tight["bound"] == "interpolated" and tight["rate"] == pytest.approx(2.4)
