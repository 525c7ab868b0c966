"""The planner's profiles are keyed by the weights' quantization and the KV dtype as the worker
builds them: an FP8 profile never plans a bf16 deployment nor the reverse, and `pdserve plan`
with FP8 flags plans from the FP8 profile, prints its key and launches FP8 nodes."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

import pytest
import torch

from benchmarks.fp8_config import write_block_config
from common.engine.config import CacheConfig, EngineConfig
from pdserve.cli import main
from pdserve.planner.profile import ProfileCache
from pdserve.planner.profiler import cpu_threads, profile_key
from tests.pd_stack import ROOT
from tests.test_planner_plan import WORKLOAD, parse_serve, synthetic_profile

CONFIGS = ROOT / "benchmarks" / "configs"
QWEN = str(CONFIGS / "qwen2.5-7b-instruct")
HAS_KV_DTYPE = "kv_cache_dtype" in {f.name for f in dataclasses.fields(CacheConfig)}


def key_of(model: str | None, **options):
    return profile_key(EngineConfig.from_options(model=model, **options))


def test_a_profile_plans_only_the_weight_quantization_and_kv_dtype_it_measured(tmp_path):
    cache = ProfileCache(tmp_path / "profiles.json")
    bf16 = synthetic_profile()
    fp8 = synthetic_profile(quantization="fp8-channel-token", kv_dtype="float8_e4m3fn")
    cache.put(bf16)
    for other in (
        fp8.key,
        replace(bf16.key, quantization="fp8-channel-token"),  # W8A8, bf16 KV
        replace(bf16.key, kv_dtype="float8_e4m3fn"),  # bf16 weights, FP8 KV
    ):
        assert cache.get(other) is None, other
    cache.put(fp8)
    assert cache.get(fp8.key) == fp8 and cache.get(bf16.key) == bf16
    assert len(json.loads(cache.path.read_text())) == 2


def test_the_key_names_the_weights_as_the_worker_builds_them(tmp_path):
    cpu = {"load_format": "dummy", "device": "cpu", "dtype": "bfloat16"}
    plain, fp8 = key_of(QWEN, **cpu), key_of(QWEN, quantization="fp8", **cpu)
    assert (plain.quantization, plain.kv_dtype) == ("none", "bfloat16")
    assert (fp8.quantization, fp8.kv_dtype) == ("fp8-channel-token", "bfloat16")
    assert plain.as_text() != fp8.as_text()
    assert "weights fp8-channel-token, KV bfloat16" in fp8.describe()
    # A config stating 128 x 128 FP8 blocks is block-wise with or without the flag.
    block = str(write_block_config(CONFIGS / "qwen3-8b", tmp_path / "qwen3-8b-fp8"))
    assert key_of(block, **cpu).quantization == "fp8-block128x128-group"
    assert key_of(block, quantization="fp8", **cpu).quantization == "fp8-block128x128-group"


@pytest.mark.skipif(not HAS_KV_DTYPE, reason="CacheConfig.kv_cache_dtype not merged yet")
def test_an_fp8_kv_cache_gets_its_own_key():
    cpu = {"load_format": "dummy", "device": "cpu", "dtype": "bfloat16"}
    bf16, fp8 = key_of(QWEN, **cpu), key_of(QWEN, kv_cache_dtype="fp8", **cpu)
    assert fp8.kv_dtype == "float8_e4m3fn" and fp8.quantization == "none"
    assert replace(fp8, kv_dtype=bf16.kv_dtype) == bf16


def test_plan_with_fp8_weights_uses_the_fp8_profile_prints_its_key_and_launches_fp8(
    tmp_path, capsys
):
    threads = torch.get_num_threads()
    out = tmp_path / "plan.json"
    try:
        torch.set_num_threads(cpu_threads(2))  # as the plan sets it for --devices 2 on CPU
        fp8_key, bf16_key = key_of(None, quantization="fp8"), key_of(None)
        cache = ProfileCache(tmp_path / "profiles.json")
        cache.put(replace(synthetic_profile(), key=fp8_key))
        assert cache.get(bf16_key) is None  # a bf16 plan would measure its own profile
        argv = ["plan", "--quantization", "fp8", *WORKLOAD, "--slo", "ttft:20000", "tpot:2000",
                "--profile-cache", str(cache.path), "--out", str(out)]  # fmt: skip
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert f"profile from {cache.path} ({fp8_key.describe()}" in printed
    assert "weights fp8-channel-token" in printed
    predictions = json.loads(out.read_text())["predictions"]
    assert predictions
    for p in predictions:
        assert "--quantization fp8" in p["command"]
        engines = parse_serve(p["command"]).engines.values()
        assert all(e.model.quantization == "fp8" for e in engines)
