"""The planner's decode cost for mixture-of-experts models: a step pays for the experts its
batch touches under uniform routing (E * (1 - (1 - k/E)^B) of them), a fit on synthetic
profile points recovers that term, a profile keeps it through the cache, and the key tells
MoE profiles (and their expert layout) from dense ones."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from benchmarks.moe_configs import write_tiny
from common.engine.config import EngineConfig
from common.model.distributed import TPGroup
from common.model.loader import build_model
from common.model.source import read_spec, resolve_model
from pdserve.planner.cost_model import (
    CostModel,
    DecodeFit,
    ExpertLoad,
    PrefillFit,
    expected_touched,
    fit_decode,
    max_relative_error,
)
from pdserve.planner.profile import DecodePoint, Profile, ProfileCache
from pdserve.planner.profiler import ProfileGrid, Profiler, expert_load, profile_key
from tests.test_planner_plan import synthetic_profile

# Qwen3-30B-A3B's experts: 128, top 8, 48 layers of 3 x 2048 x 768 bf16 weights each.
QWEN3_30B = ExpertLoad(128, 8, 128, 48 * 3 * 2048 * 768 * 2)
BATCHES, CONTEXTS = (1, 8, 32, 64, 128, 256), (256, 1024, 4096)


def test_expected_touched_experts_match_uniform_routing_draws():
    assert expected_touched(128, 8, 1) == pytest.approx(8)
    assert expected_touched(128, 8, 0) == 0.0
    assert expected_touched(128, 8, 1000) == pytest.approx(128)
    rng = random.Random(0)
    for tokens in (4, 16, 64):
        draws = [len({e for _ in range(tokens) for e in rng.sample(range(64), 6)})
                 for _ in range(2000)]  # fmt: skip
        assert sum(draws) / len(draws) == pytest.approx(expected_touched(64, 6, tokens), rel=0.01)
    with pytest.raises(ValueError, match="top_k 9 must be in 1..num_experts 8"):
        expected_touched(8, 9, 1)


def test_expert_parallel_ranks_read_their_share_of_the_touched_experts():
    half = replace(QWEN3_30B, local_experts=64)
    for batch in (1, 32, 256):
        assert half.touched_bytes(batch) == pytest.approx(QWEN3_30B.touched_bytes(batch) / 2)
    assert QWEN3_30B.touched_bytes(1) == 8 * QWEN3_30B.bytes_per_expert
    with pytest.raises(ValueError, match="129 local experts of 128"):
        replace(QWEN3_30B, local_experts=129)


def test_decode_fit_recovers_the_touched_expert_term_and_a_dense_fit_cannot():
    truth = DecodeFit(0.004, 2e-5, 1e-8, 1 / 4.0e12, QWEN3_30B)  # experts at 4 TB/s
    rng = random.Random(1)
    points = [
        DecodePoint(b, c, truth.time(b, b * c) * (1 + rng.uniform(-0.01, 0.01)))
        for b in BATCHES
        for c in CONTEXTS
    ]
    fit = fit_decode(points, QWEN3_30B)
    assert fit.experts == QWEN3_30B
    assert fit.per_expert_byte == pytest.approx(1 / 4.0e12, rel=0.1)
    assert fit.per_context_token == pytest.approx(1e-8, rel=0.1)
    prefill = PrefillFit((1,), (0.01,))
    assert max_relative_error(CostModel(prefill, fit), [], points) < 0.02
    # The experts' step time saturates with the batch: a line in the batch misses it.
    dense = fit_decode(points)
    assert dense.experts is None and dense.per_expert_byte == 0.0
    assert max_relative_error(CostModel(prefill, dense), [], points) > 0.1


def test_noise_free_points_are_reproduced_exactly():
    truth = DecodeFit(0.003, 1e-5, 2e-8, 1 / 3.0e12, QWEN3_30B)
    points = [DecodePoint(b, c, truth.time(b, b * c)) for b in BATCHES for c in CONTEXTS]
    fit = fit_decode(points, QWEN3_30B)
    for got, want in zip(
        (fit.base, fit.per_seq, fit.per_context_token, fit.per_expert_byte),
        (truth.base, truth.per_seq, truth.per_context_token, truth.per_expert_byte),
        strict=True,
    ):
        assert got == pytest.approx(want, rel=1e-6)
    # Several steps of one batch: the expert term is paid every step.
    assert fit.steps_time(32, 32 * 1024, 5) == pytest.approx(
        sum(truth.time(32, 32 * (1024 + i)) for i in range(5)), rel=1e-6
    )


def test_an_moe_profile_round_trips_through_the_cache_and_keys_apart_from_dense(tmp_path):
    dense = synthetic_profile()
    points = [DecodePoint(b, c, 0.004 + 1e-8 * b * c + QWEN3_30B.touched_bytes(b) / 4e12)
              for b in BATCHES for c in CONTEXTS]  # fmt: skip
    cost = CostModel(dense.cost.prefill, fit_decode(points, QWEN3_30B))
    key = replace(dense.key, experts="moe128top8-tp")
    moe = Profile(key, dense.prefill, tuple(points), dense.memory, cost, "now")
    cache = ProfileCache(tmp_path / "profiles.json")
    cache.put(dense)
    cache.put(moe)
    again = ProfileCache(cache.path).get(key)
    assert again == moe and again.cost.decode.experts == QWEN3_30B
    assert cache.get(replace(key, experts="moe128top8-ep")) is None
    assert cache.get(dense.key) == dense and dense.key.experts == "dense"
    assert "experts moe128top8-tp" in key.describe()
    assert "experts" not in dense.key.describe()


def test_the_key_and_the_expert_load_come_from_the_model(tmp_path):
    directory = str(write_tiny("qwen3-moe", tmp_path / "tiny"))
    cpu = {"load_format": "dummy", "device": "cpu", "dtype": "float32"}
    assert profile_key(EngineConfig.from_options(model=directory, **cpu)).experts == "moe16top4-tp"
    assert profile_key(EngineConfig.from_options(model=None, **cpu)).experts == "dense"
    source = resolve_model(directory)
    spec = read_spec(source)
    per_expert = 2 * 3 * 64 * 32 * 4  # two MoE layers of gate, up and down, float32
    for tp, local in ((TPGroup.single(), 16), (TPGroup(0, 2, expert_parallel=True), 8)):
        model = build_model(spec, source, max_positions=64, dtype=torch.float32,
                            device=torch.device("meta"), load_format="dummy", tp=tp)  # fmt: skip
        assert expert_load(model) == ExpertLoad(16, 4, local, per_expert)


def test_the_profiler_fits_a_tiny_moe_with_its_expert_term(tmp_path):
    directory = str(write_tiny("qwen3-moe", tmp_path / "tiny"))
    config = EngineConfig.from_options(
        model=directory, load_format="dummy", device="cpu", dtype="float32"
    )
    grid = ProfileGrid(prefill_tokens=(8, 32), chunk_contexts=(32,), chunk_tokens=(16,),
                       decode_batches=(1, 2, 4), decode_contexts=(16, 48), decode_steps=2,
                       repeats=1)  # fmt: skip
    key = profile_key(config)
    profile = Profiler(config, grid, log=lambda line: None).run(key)
    assert profile.key.experts == "moe16top4-tp"
    assert profile.cost.decode.experts == ExpertLoad(16, 4, 16, 2 * 3 * 64 * 32 * 4)
    assert len(profile.decode) == 6 and all(p.seconds > 0 for p in profile.decode)
    assert profile.cost.decode.time(4, 4 * 48) > 0
