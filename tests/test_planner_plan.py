"""`pdserve plan` end to end on CPU: the real profiler on the embedded model (the engine step
the nodes run), its cache, the search and its ranking, the printed command parsed back by the
real `pdserve serve` parser, and `--validate` launching two layouts through launch_pd.sh and
measuring them with the serving benchmark."""

from __future__ import annotations

import json
import random
import shlex
from dataclasses import replace

import pytest
import torch

from benchmarks.loadgen.metrics import SLO
from pdserve.cli import main
from pdserve.flags import build_parser
from pdserve.plan import configs_from_args
from pdserve.planner.cost_model import fit
from pdserve.planner.layout import Knobs, Layout
from pdserve.planner.profile import (
    DecodePoint,
    MemoryInfo,
    PrefillPoint,
    Profile,
    ProfileCache,
    ProfileKey,
)
from pdserve.planner.report import launch_args, serve_command, user_engine_flags
from pdserve.planner.search import (
    ROUTER_MAX_UTILIZATION,
    Objective,
    Problem,
    SearchSpace,
    SimParams,
    max_rate,
    search,
)
from pdserve.planner.simulator import SimRequest

TINY_PROFILE = [
    "--profile-prefill-tokens", "8", "32", "--profile-chunk-contexts", "32",
    "--profile-chunk-tokens", "16", "--profile-decode-batches", "1", "2",
    "--profile-decode-contexts", "16", "48", "--profile-repeats", "1",
]  # fmt: skip
WORKLOAD = [
    "--dataset", "random", "--input-len", "16:32", "--output-len", "2:4", "--num-prompts", "40",
    "--search-prefill-tokens", "64", "--search-decode-seqs", "4", "--search-colocated-tokens",
    "64", "--layouts", "1p1d", "2c", "--jobs", "1", "--devices", "2",
]  # fmt: skip


def synthetic_profile(
    device: str = "NVIDIA H200",
    version: str = "abc",
    quantization: str = "none",
    kv_dtype: str = "bfloat16",
) -> Profile:
    """A GPU-like profile from known step times (as the profiler would store it)."""
    prefill = [PrefillPoint(t, 0, 0.008 + t * 2.5e-5) for t in (16, 512, 2048, 8192)]
    prefill.append(PrefillPoint(2048, 4096, 0.008 + 2048 * 2.5e-5 + 2e-9 * 2048 * 4096))
    decode = [
        DecodePoint(b, c, 0.006 + 4e-5 * b + 1e-8 * b * c)
        for b in (1, 32, 128)
        for c in (256, 4096)
    ]
    memory = MemoryInfo(57344, 16, 60 * 2**30, 15 * 2**30, 140 * 2**30, 0.85)
    key = ProfileKey(
        "qwen2.5-7b|dummy|bs16", "bfloat16", quantization, kv_dtype, device, 1, version
    )
    return Profile(key, tuple(prefill), tuple(decode), memory, fit(prefill, decode), "now")


def test_the_profile_cache_round_trips_and_a_different_key_misses(tmp_path):
    cache = ProfileCache(tmp_path / "profiles.json")
    profile = synthetic_profile()
    assert cache.get(profile.key) is None
    cache.put(profile)
    cache.put(synthetic_profile(device="NVIDIA H100 80GB HBM3"))  # a second entry, kept apart
    again = ProfileCache(tmp_path / "profiles.json").get(profile.key)
    assert again == profile
    assert again.cost.prefill.time(1000) == profile.cost.prefill.time(1000)
    for other in (
        synthetic_profile(version="def").key,
        synthetic_profile(device="cpu:2threads").key,
        replace(profile.key, tp=2),
    ):
        assert cache.get(other) is None, other
    assert len(json.loads((tmp_path / "profiles.json").read_text())) == 2


def test_kv_capacity_follows_the_memory_fraction_on_gpu_and_is_fixed_on_cpu():
    gpu = synthetic_profile().memory
    assert gpu.kv_blocks(0.9) > gpu.kv_blocks(0.85) == gpu.kv_blocks(None)
    extra = int(0.05 * gpu.total_bytes) // (gpu.kv_bytes_per_token * gpu.block_size)
    assert gpu.kv_blocks(0.9) - gpu.kv_blocks(0.85) == pytest.approx(extra, abs=1)
    cpu = MemoryInfo(46080, 16, 2**30, 10**8)
    assert cpu.kv_blocks(0.9) == cpu.kv_blocks(None) == 2**30 // (46080 * 16) - 1


def problem(slo: list[str], n: int = 200) -> Problem:
    rng, t, requests = random.Random(4), 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.0)
        requests.append(SimRequest(t, rng.randint(1024, 4096), rng.randint(64, 256)))
    return Problem(
        {1: synthetic_profile()}, tuple(requests), Objective(SLO.parse(slo), 0.9),
        SimParams(kv_bandwidth=100e9, overhead_s=0.005),
    )  # fmt: skip


def test_a_looser_slo_never_lowers_the_predicted_goodput():
    space = SearchSpace(4, prefill_tokens=(2048,), decode_seqs=(64,), colocated_tokens=(1024,))
    slos = (["ttft:500", "tpot:15"], ["ttft:1000", "tpot:20"], ["ttft:3000", "tpot:50"])
    goodputs = []
    for slo in slos:
        p = problem(slo)
        goodputs.append(
            {
                layout.name: max_rate(p, layout, knobs).goodput
                for layout, knobs in space.candidates((1,))
            }
        )
    for tight, loose in zip(goodputs, goodputs[1:], strict=False):
        assert all(loose[name] >= tight[name] for name in tight), (tight, loose)
    assert sum(goodputs[-1].values()) > sum(goodputs[0].values())


def test_search_ranks_passing_candidates_by_goodput_per_device_with_their_percentiles():
    space = SearchSpace(2, prefill_tokens=(1024, 4096), decode_seqs=(64,), colocated_tokens=(512,))
    ranked = search(problem(["ttft:3000", "tpot:50"], n=120), space)
    assert {p.layout.name for p in ranked} == {"1p1d", "2c"}
    assert len(ranked) == 3  # two prefill budgets for 1p1d, one chunk size for 2c
    per_device = [p.goodput_per_device for p in ranked if p.goodput > 0]
    assert per_device == sorted(per_device, reverse=True) and per_device
    best = ranked[0]
    assert best.attainment >= 0.9
    assert best.ttft_ms["p50"] <= best.ttft_ms["p90"] <= best.ttft_ms["p99"]
    assert best.ttft_ms["p50"] <= 3000 and best.tpot_ms["p50"] <= 50


def test_a_router_that_cannot_stream_the_tokens_caps_the_goodput():
    space = SearchSpace(4, prefill_tokens=(2048,), decode_seqs=(128,), colocated_tokens=(1024,))
    (layout, knobs), *_ = space.candidates((1,))
    free = problem(["ttft:3000", "tpot:50"])
    slow_router = replace(free, params=replace(free.params, router_s_per_token=1e-3))
    unbounded = max_rate(free, layout, knobs).goodput
    mean_output = sum(r.output_len for r in free.requests) / len(free.requests)
    cap = ROUTER_MAX_UTILIZATION / (mean_output * 1e-3)  # requests/s the router can stream
    assert unbounded > cap
    assert max_rate(slow_router, layout, knobs).goodput <= cap


def parse_serve(command: str):
    argv = shlex.split(command)
    assert argv[:2] == ["pdserve", "serve"]
    return configs_from_args(build_parser().parse_args(argv[1:]))


def test_the_printed_command_parses_with_the_real_serve_parser():
    options = {
        "prefill": {"load_format": "dummy", "dtype": "bfloat16", "max_num_seqs": 32},
        "decode": {"load_format": "dummy", "dtype": "bfloat16", "max_num_seqs": 8},
    }
    user = user_engine_flags(options, {"transport", "gpu_memory_fraction"})
    pd = Knobs(64, 2048, 4096, 0.9)
    args = launch_args(Layout(3, 1), pd, gpu=True, user_flags=user, transport="cuda_ipc")
    configs = parse_serve(serve_command("benchmarks/configs/qwen2.5-7b-instruct", args))
    assert (configs.launch.num_prefill, configs.launch.num_decode) == (3, 1)
    assert configs.launch.prefill_gpus == (0, 1, 2) and configs.launch.decode_gpus == (3,)
    prefill, decode = configs.engines["prefill"], configs.engines["decode"]
    assert prefill.scheduler.max_num_batched_tokens == 4096
    assert prefill.scheduler.max_num_seqs == 32  # the user's, for the pool the knobs leave
    assert decode.scheduler.max_num_seqs == 64  # the knob wins over the user's 8
    assert prefill.cache.gpu_memory_fraction == decode.cache.gpu_memory_fraction == 0.9
    assert prefill.model.load_format == "dummy" and decode.model.dtype == "bfloat16"
    assert configs.nodes["prefill"].transport == "cuda_ipc"

    colo = launch_args(Layout(0, 4, True), Knobs(128, 1024, None, None), gpu=True)
    configs = parse_serve(serve_command(None, colo))
    assert configs.launch.colocated and configs.launch.decode_gpus == (0, 1, 2, 3)
    assert configs.engines["decode"].scheduler.max_num_batched_tokens == 1024
    with pytest.raises(ValueError, match="no TP flags"):
        launch_args(Layout(1, 1, False, 2, 1), pd, gpu=True)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """One real plan on CPU: profiles the embedded model with a tiny grid into a fresh cache."""
    tmp = tmp_path_factory.mktemp("plan")
    cache, out = tmp / "profiles.json", tmp / "plan.json"
    threads = torch.get_num_threads()
    argv = ["plan", *TINY_PROFILE, *WORKLOAD, "--slo", "ttft:20000", "tpot:2000",
            "--profile-cache", str(cache), "--out", str(out)]  # fmt: skip
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # the plan sets the launcher's per-node share
    return tmp, cache, json.loads(out.read_text())


def test_the_profiler_measures_the_engine_and_the_fits_are_stored(planned):
    _, cache, _ = planned
    (entry,) = json.loads(cache.read_text()).values()
    assert entry["key"]["device"].startswith("cpu:") and entry["key"]["dtype"] == "float32"
    assert [(p["tokens"], p["context"]) for p in entry["prefill"]] == [(8, 0), (32, 0), (16, 32)]
    assert [(p["batch"], p["context"]) for p in entry["decode"]] == [
        (1, 16),
        (2, 16),
        (1, 48),
        (2, 48),
    ]
    assert all(p["seconds"] > 0 for p in entry["prefill"] + entry["decode"])
    assert entry["memory"]["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4  # SmolLM2-135M, fp32
    assert entry["memory"]["total_bytes"] is None  # CPU: a fixed byte budget
    knots = entry["cost"]["prefill"]["knot_seconds"]
    assert knots == sorted(knots) and entry["cost"]["prefill"]["knot_tokens"] == [8, 32]


def test_plan_ranks_both_layouts_and_every_command_starts_with_real_flags(planned):
    _, _, result = planned
    predictions = result["predictions"]
    assert {p["layout"] for p in predictions} == {"1p1d", "2c"}
    best = predictions[0]
    assert best["goodput"] > 0 and best["attainment"] >= 0.9
    for p in predictions:
        configs = parse_serve(p["command"])
        assert configs.launch.colocated == (p["layout"] == "2c")
        assert configs.engines["decode"].scheduler.max_num_seqs == 4


def test_validate_launches_two_layouts_and_sets_measured_beside_predicted(planned, capsys):
    tmp, cache, _ = planned
    out = tmp / "validated.json"
    argv = ["plan", *TINY_PROFILE, *WORKLOAD, "--slo", "ttft:600000", "tpot:600000",
            "--profile-cache", str(cache), "--out", str(out), "--request-rate", "0.5",
            "--validate", "2", "--validate-duration", "4", "--validate-warmup", "1",
            "--validate-out", str(tmp / "v")]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "profile from" in printed  # the cached profile: no second measurement
    assert "predicted against measured" in printed
    rows = json.loads(out.read_text())["validation"]
    assert {r["layout"] for r in rows} == {"1p1d", "2c"}
    for r in rows:
        assert r["measured_goodput_per_device"] > 0
        assert r["measured_ttft_p90_ms"] > 0 and r["predicted_ttft_p90_ms"] > 0
        assert any(flag == "--decode-max-num-seqs" for flag in r["launch_args"])
    for layout in ("1p1d", "2c"):
        record = json.loads((tmp / "v" / f"{layout}.json").read_text())
        assert record["layouts"][0]["orphans"] == []


def test_the_simulated_workload_is_the_benchmarks_requests_and_arrival_schedule():
    from benchmarks.loadgen.runner import arrival_offsets
    from benchmarks.loadgen.workloads import build_workload
    from pdserve.planner.config import PlanConfig
    from pdserve.planner.search import at_rate
    from pdserve.planner.workload import sim_requests, workload_config

    config = PlanConfig(dataset="shared-prefix", num_prompts=30, workload_seed=3, prefix_len=64)
    requests = sim_requests(config)
    specs = build_workload(workload_config(config))
    assert [r.prompt_len for r in requests] == [s.prompt_len for s in specs]
    assert [r.output_len for r in requests] == [s.output_len for s in specs]
    assert all(r.group is not None and r.prefix_len == 64 for r in requests)
    # At rate R the benchmark sends at arrival_offsets(n, R): the planner's rescaled schedule.
    sent = arrival_offsets(30, 4.0, 1.0, 3)
    assert [r.arrival for r in at_rate(requests, 4.0)] == pytest.approx(sent)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--slo", "ttft"], "bad SLO"),
        (["--dataset", "nope"], "unknown dataset"),
        (["--request-rate", "fast"], "request_rate"),
        (["--devices", "0"], "devices must be"),
    ],
)
def test_bad_plan_flags_end_with_one_line_and_exit_code_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
