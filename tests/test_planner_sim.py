"""The planner's pure-Python core: cost fits that reproduce their raw points, and a simulator
that agrees with queueing theory where it has a closed form, is deterministic, and never
predicts less capacity for more devices."""

from __future__ import annotations

import random

import pytest

from pdserve.planner.cost_model import (
    CostModel,
    DecodeFit,
    PrefillFit,
    attention_pairs,
    fit_decode,
    fit_prefill,
    max_relative_error,
)
from pdserve.planner.layout import Layout, candidate_layouts
from pdserve.planner.profile import DecodePoint, PrefillPoint
from pdserve.planner.simulator import PoolSetup, SimConfig, SimRequest, simulate


def constant_cost(service_s: float) -> CostModel:
    """Every prefill step takes `service_s`, whatever its size."""
    return CostModel(PrefillFit((1, 10**6), (service_s, service_s)), DecodeFit(0.001, 0.0, 0.0))


def poisson(n: int, rate: float, seed: int, prompt: int = 64, output: int = 1) -> list[SimRequest]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(SimRequest(t, prompt, output))
    return out


def pd_config(layout: Layout, cost: CostModel, prefill_tokens=64, seqs=128, blocks=10**6):
    prefill = PoolSetup(cost, prefill_tokens, 1 if prefill_tokens == 64 else 128, blocks)
    prefill = None if layout.colocated else prefill
    return SimConfig(layout, PoolSetup(cost, 2048, seqs, blocks), prefill, 16, 1000, 1e12)


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_one_prefill_server_matches_the_md1_mean_waiting_time(rho):
    """One prefill node that takes one prompt per step of fixed length D under Poisson
    arrivals is an M/D/1 queue: mean wait rho*D / (2(1 - rho)) (Pollaczek-Khinchine)."""
    service = 0.1
    requests = poisson(30_000, rho / service, seed=1)
    result = simulate(pd_config(Layout(1, 1), constant_cost(service)), requests)
    waits = [o.ttft - service for o in result.outcomes]
    expected = rho * service / (2 * (1 - rho))
    assert sum(waits) / len(waits) == pytest.approx(expected, rel=0.05)
    assert min(waits) == pytest.approx(0.0, abs=1e-9)  # an idle server starts at once


def gpu_like_cost() -> CostModel:
    prefill = PrefillFit((16, 512, 2048, 8192), (0.010, 0.03, 0.12, 0.5), 1e-9)
    return CostModel(prefill, DecodeFit(0.006, 0.00005, 1e-8))


def long_prompts(n: int, rate: float, seed: int) -> list[SimRequest]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(SimRequest(t, rng.randint(2048, 8192), rng.randint(128, 512)))
    return out


def test_the_simulation_is_deterministic_and_every_request_finishes():
    requests = long_prompts(300, 6.0, seed=2)
    for layout in (Layout(2, 2), Layout(0, 4, True)):
        config = pd_config(layout, gpu_like_cost(), 2048, 128, 20_000)
        a, b = simulate(config, requests), simulate(config, requests)
        assert a == b
        assert all(o.ttft is not None and o.e2e is not None for o in a.outcomes)
        assert all(o.e2e > o.ttft > 0 for o in a.outcomes)


def test_a_small_kv_pool_makes_requests_wait_for_blocks_and_still_finishes_all():
    requests = long_prompts(200, 20.0, seed=3)
    roomy = simulate(pd_config(Layout(2, 1), gpu_like_cost(), 2048, 128, 200_000), requests)
    tight = simulate(pd_config(Layout(2, 1), gpu_like_cost(), 2048, 128, 3_000), requests)
    assert all(o.e2e is not None for o in tight.outcomes)
    assert tight.duration > roomy.duration
    mean = lambda r: sum(o.e2e for o in r.outcomes) / len(r.outcomes)  # noqa: E731
    assert mean(tight) > 1.2 * mean(roomy)


def decode_throughput(num_decode: int, seed: int) -> float:
    """Requests per second a 1pYd layout finishes under an overload its prefill node keeps up
    with (short prompts, long outputs, a small running set): the decode pool's capacity."""
    rng, out = random.Random(seed), []
    for i in range(400):
        out.append(SimRequest(i * 0.002, 32, rng.randint(200, 400)))
    cost = CostModel(PrefillFit((16, 4096), (0.001, 0.01)), DecodeFit(0.01, 0.0005, 1e-7))
    result = simulate(pd_config(Layout(1, num_decode), cost, 2048, 16, 10**5), out)
    return len(out) / result.duration


@pytest.mark.parametrize("seed", [0, 1])
def test_more_decode_devices_never_lower_the_predicted_decode_capacity(seed):
    capacity = [decode_throughput(y, seed) for y in (1, 2, 3, 4)]
    assert all(b >= a for a, b in zip(capacity, capacity[1:], strict=False)), capacity
    assert capacity[-1] > 2.5 * capacity[0]


def test_piecewise_prefill_fit_goes_through_its_points_and_adds_attention_for_context():
    truth = PrefillFit((16, 256, 1024, 4096), (0.01, 0.02, 0.06, 0.25), 2e-9)
    points = [PrefillPoint(t, 0, truth.time(t)) for t in truth.knot_tokens]
    points += [
        PrefillPoint(t, c, truth.time(t, attention_pairs(t, c)))
        for t in (256, 1024)
        for c in (1024, 3072)
    ]
    fit = fit_prefill(points)
    assert fit.knot_tokens == truth.knot_tokens
    assert fit.seconds_per_pair == pytest.approx(2e-9, rel=1e-6)
    model = CostModel(fit, DecodeFit(0.01, 0.001, 0.0))
    assert max_relative_error(model, points, []) < 1e-6
    assert fit.time(2048) == pytest.approx(0.06 + (0.25 - 0.06) * (2048 - 1024) / 3072)


def test_decode_fit_recovers_a_linear_step_time_within_noise():
    rng = random.Random(0)
    points = [
        DecodePoint(b, c, (0.004 + 0.0002 * b + 3e-8 * b * c) * (1 + rng.uniform(-0.02, 0.02)))
        for b in (1, 4, 16, 64)
        for c in (128, 1024, 4096)
    ]
    fit = fit_decode(points)
    assert fit.base == pytest.approx(0.004, rel=0.15)
    assert fit.per_seq == pytest.approx(0.0002, rel=0.15)
    assert fit.per_context_token == pytest.approx(3e-8, rel=0.15)
    prefill = PrefillFit((1,), (0.01,))
    assert max_relative_error(CostModel(prefill, fit), [], points) < 0.05


def test_decode_fit_keeps_coefficients_non_negative():
    points = [DecodePoint(b, 100, 0.01) for b in (1, 2, 4, 8)]  # flat: no per-seq cost
    fit = fit_decode(points)
    assert fit.per_seq >= 0 and fit.per_context_token >= 0
    assert fit.time(4, 400) == pytest.approx(0.01, rel=1e-6)


def test_candidate_layouts_cover_every_split_and_the_colocated_baseline():
    names = [x.name for x in candidate_layouts(4)]
    assert names == ["1p1d", "1p2d", "1p3d", "2p1d", "2p2d", "3p1d", "4c"]
    assert all(x.devices <= 4 for x in candidate_layouts(4, (1, 2)))
    assert Layout.parse("1p(tp2)2d") == Layout(1, 2, False, 2, 1)
    assert Layout.parse("1p(tp2)2d").devices == 4 and Layout.parse("3c").colocated
    with pytest.raises(ValueError, match="neither"):
        Layout.parse("2x2")
