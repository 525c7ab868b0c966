"""Candidates (layout x knobs), each one's predicted goodput, and the ranking. Pure Python.

Goodput follows the serving benchmark (`benchmarks/sweep_layouts.py`, DistServe's definition):
with a request rate of "max", the highest rate at which at least `attainment` of all requests
meet every SLO, per device; at a fixed rate, the requests per second that met them. The rate
search scales one arrival schedule (gamma gaps scale with 1 / rate for a fixed seed), so every
rate sees the same requests in the same order: a higher rate or a tighter SLO can only move the
answer one way. Candidates are independent and run in worker processes (`jobs`).
"""

from __future__ import annotations

import itertools
import math
import multiprocessing as mp
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from pdserve.planner.layout import Knobs, Layout, candidate_layouts
from pdserve.planner.profile import Profile
from pdserve.planner.simulator import PoolSetup, SimConfig, SimRequest, SimResult, simulate
from pdserve.workload.slo import SLO, percentile

SCAN = 1.5  # rate scan factor; then BISECT halvings of the bracket
BISECT = 6
MAX_SCAN = 16  # 1.5**16 ~ 650x the first guess


@dataclass(frozen=True)
class SearchSpace:
    devices: int
    prefill_tokens: tuple[int, ...] = (1024, 2048, 4096)  # prefill max-num-batched-tokens
    decode_seqs: tuple[int, ...] = (64, 128, 256)  # decode (and colocated) max-num-seqs
    colocated_tokens: tuple[int, ...] = (512, 1024, 2048)  # colocated chunk budget
    kv_fractions: tuple[float | None, ...] = (None,)  # None: the pool the profile measured
    layouts: tuple[Layout, ...] = ()  # () = every layout on `devices`
    decode_tokens: int = 2048  # a PD decode pool's step budget (decodes need one token each)

    def candidates(self, tp_sizes: tuple[int, ...]) -> list[tuple[Layout, Knobs]]:
        layouts = self.layouts or tuple(candidate_layouts(self.devices, tp_sizes))
        out = []
        for layout in layouts:
            if layout.devices > self.devices:
                raise ValueError(
                    f"layout {layout.name} needs {layout.devices} devices, have {self.devices}"
                )
            tokens = self.colocated_tokens if layout.colocated else self.prefill_tokens
            for t, seqs, f in itertools.product(tokens, self.decode_seqs, self.kv_fractions):
                if layout.colocated:
                    out.append((layout, Knobs(seqs, max(t, seqs), None, f)))
                else:
                    out.append((layout, Knobs(seqs, max(self.decode_tokens, seqs), t, f)))
        return out


@dataclass(frozen=True)
class SimParams:
    kv_bandwidth: float  # bytes/s
    transfer_latency_s: float = 0.0
    overhead_s: float = 0.0
    decode_policy: str = "least_load"
    prefill_policy: str = "least_load"
    kv_growth_headroom: float = 0.1
    prefill_max_num_seqs: int = 128
    kv_blocks: int | None = None  # fixed pool size per node (--num-kv-blocks and the like)
    # The router is one process that streams every token (issue 9: it saturated near 8,000
    # tokens/s on the H200 host). A rate that keeps it busier than ROUTER_MAX_UTILIZATION
    # fails, whatever the nodes could do. 0: not modelled.
    router_s_per_token: float = 0.0


ROUTER_MAX_UTILIZATION = 0.85


@dataclass(frozen=True)
class Objective:
    slo: SLO
    attainment: float = 0.9
    rate: float | None = None  # None: find the highest rate meeting the SLO


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    knobs: Knobs
    rate: float  # the request rate it was judged at (the goodput rate for "max")
    goodput: float  # req/s meeting every SLO
    attainment: float
    ttft_ms: dict[str, float]  # p50, p90, p99 at `rate`
    tpot_ms: dict[str, float]

    @property
    def goodput_per_device(self) -> float:
        return self.goodput / self.layout.devices


@dataclass(frozen=True)
class Problem:
    """Everything one candidate's evaluation needs (sent to a worker process)."""

    profiles: dict[int, Profile]  # by TP size
    requests: tuple[SimRequest, ...]  # arrivals at 1 request/s
    objective: Objective
    params: SimParams


def sim_config(problem: Problem, layout: Layout, knobs: Knobs) -> SimConfig:
    p = problem.params

    def pool(tp: int, tokens: int, seqs: int) -> PoolSetup:
        profile = problem.profiles.get(tp)
        if profile is None:
            raise ValueError(f"no profile for TP {tp}; profiled: {sorted(problem.profiles)}")
        blocks = p.kv_blocks or profile.memory.kv_blocks(knobs.kv_memory_fraction)
        return PoolSetup(profile.cost, tokens, seqs, blocks)

    decode = pool(layout.decode_tp, knobs.decode_max_num_batched_tokens, knobs.decode_max_num_seqs)
    prefill = None
    if not layout.colocated:
        tokens = knobs.prefill_max_num_batched_tokens or knobs.decode_max_num_batched_tokens
        prefill = pool(layout.prefill_tp, tokens, p.prefill_max_num_seqs)
    memory = problem.profiles[layout.decode_tp].memory
    return SimConfig(
        layout, decode, prefill, memory.block_size, memory.kv_bytes_per_token, p.kv_bandwidth,
        p.transfer_latency_s, p.overhead_s, p.decode_policy, p.prefill_policy,
        p.kv_growth_headroom,
    )  # fmt: skip


def at_rate(requests: Sequence[SimRequest], rate: float) -> list[SimRequest]:
    return [replace(r, arrival=r.arrival / rate) for r in requests]


def score(result: SimResult, slo: SLO) -> tuple[int, dict[str, float], dict[str, float]]:
    """Requests meeting the SLO, and the TTFT and TPOT percentiles (ms)."""
    good = sum(slo.met_times(o.ttft, o.tpot, o.e2e) for o in result.outcomes)
    ttfts = [o.ttft * 1000 for o in result.outcomes if o.ttft is not None]
    tpots = [t * 1000 for o in result.outcomes if (t := o.tpot) is not None]
    return good, _percentiles(ttfts), _percentiles(tpots)


def _percentiles(values: list[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) if values else math.nan for q in (50, 90, 99)}


def evaluate(problem: Problem, layout: Layout, knobs: Knobs, rate: float) -> Prediction:
    config = sim_config(problem, layout, knobs)
    result = simulate(config, at_rate(problem.requests, rate))
    good, ttft, tpot = score(result, problem.objective.slo)
    if router_utilization(problem, rate) > ROUTER_MAX_UTILIZATION:
        good = 0  # the router falls behind: streams stall and every latency grows without bound
    n = len(problem.requests)
    return Prediction(layout, knobs, rate, good / max(result.duration, 1e-9), good / n, ttft, tpot)


def router_utilization(problem: Problem, rate: float) -> float:
    """The router's busy fraction streaming the workload's tokens at `rate` requests/s."""
    reqs = problem.requests
    tokens_per_request = sum(r.output_len for r in reqs) / len(reqs)
    return rate * tokens_per_request * problem.params.router_s_per_token


def max_rate(problem: Problem, layout: Layout, knobs: Knobs) -> Prediction:
    """The highest rate whose attainment reaches the objective (scan by SCAN, then bisect);
    a candidate that fails even at the lowest rate tried gets goodput 0."""
    target = problem.objective.attainment
    cache: dict[float, Prediction] = {}

    def judge(rate: float) -> Prediction:
        if rate not in cache:
            cache[rate] = evaluate(problem, layout, knobs, rate)
        return cache[rate]

    lo = hi = first_guess(problem, layout, knobs)
    if judge(lo).attainment >= target:
        for _ in range(MAX_SCAN):
            if judge(hi := hi * SCAN).attainment < target:
                break
            lo = hi
        else:  # still met far past any plausible capacity: an SLO no queue can miss
            return judge(lo)
    else:
        for _ in range(MAX_SCAN):
            hi, lo = lo, lo / SCAN
            if judge(lo).attainment >= target:
                break
        else:
            return replace(judge(lo), goodput=0.0)
    for _ in range(BISECT):
        mid = math.sqrt(lo * hi)
        if judge(mid).attainment >= target:
            lo = mid
        else:
            hi = mid
    best = judge(lo)
    return replace(best, goodput=lo)


def first_guess(problem: Problem, layout: Layout, knobs: Knobs) -> float:
    """Where the rate scan starts: the prefill pool's rate if it did nothing else (a rough
    upper bound; the scan corrects it either way)."""
    profile = problem.profiles[layout.prefill_tp if not layout.colocated else layout.decode_tp]
    reqs = problem.requests
    mean_prompt = sum(r.prompt_len for r in reqs) / len(reqs)
    step = profile.cost.prefill.time(mean_prompt)
    nodes = layout.num_prefill or layout.num_decode
    return max(nodes / max(step, 1e-6), 1e-3)


def _predict(args: tuple[Problem, Layout, Knobs]) -> Prediction:
    problem, layout, knobs = args
    if problem.objective.rate is None:
        return max_rate(problem, layout, knobs)
    return evaluate(problem, layout, knobs, problem.objective.rate)


def search(problem: Problem, space: SearchSpace, jobs: int = 1) -> list[Prediction]:
    """Every candidate's prediction, best first: those meeting the attainment target by
    goodput per device, then the rest by attainment; ties prefer fewer devices and the
    smaller KV fraction."""
    tasks = [
        (problem, layout, knobs) for layout, knobs in space.candidates(tuple(problem.profiles))
    ]
    if jobs > 1 and len(tasks) > 1:
        # spawn: the parent may hold a CUDA context (it just profiled); the workers need none
        with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
            predictions = list(pool.map(_predict, tasks, chunksize=1))
    else:
        predictions = [_predict(t) for t in tasks]
    return sorted(predictions, key=lambda p: rank_key(p, problem.objective.attainment))


def rank_key(p: Prediction, target: float) -> tuple:
    passing = p.goodput > 0 and p.attainment >= target - 1e-9
    return (
        not passing,
        -round(p.goodput_per_device, 9) if passing else -p.attainment,
        p.layout.devices,
        p.knobs.kv_memory_fraction or 0.0,
        p.layout.name,
    )
