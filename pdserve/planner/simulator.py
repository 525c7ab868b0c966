"""Replay a workload through one layout: discrete events, plain Python, deterministic.

Events: a request arrives (the router picks its nodes), a node's step ends, a KV transfer
ends. Nodes step back to back while they have work (`sim_nodes`). PD: the router sends the
request to a decode node, which reserves blocks for the prompt (FIFO, between its steps, or at
once when idle); the reserved request joins its prefill node's queue; the step that ends the
prompt samples the first token (TTFT) and ships the KV layer by layer while it computes, so the
transfer ends at max(step end, step start + bytes / bandwidth) + latency; the decode node then
admits it at its next step. Colocated: the router sends the request to one node, which
prefills it in chunks inside its decode steps. Same inputs, same outputs: ties are broken by
event order, never by a clock or a hash.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.planner.cost_model import CostModel
from pdserve.planner.layout import Layout
from pdserve.planner.sim_nodes import DecodeSim, PrefillSim, SimJob, StepPlan

POLICIES = ("least_load", "round_robin")


@dataclass(frozen=True)
class SimRequest:
    arrival: float  # seconds from the start
    prompt_len: int
    output_len: int
    group: int | None = None  # shared-prefix group (its prefix can be cached on a node)
    prefix_len: int = 0


@dataclass(frozen=True)
class PoolSetup:
    """One pool's engine: its cost model (for its TP size) and knobs."""

    cost: CostModel
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_blocks: int


@dataclass(frozen=True)
class SimConfig:
    layout: Layout
    decode: PoolSetup  # the colocated nodes' pool when layout.colocated
    prefill: PoolSetup | None
    block_size: int
    kv_bytes_per_token: int
    kv_bandwidth: float  # bytes/s of one transfer
    transfer_latency_s: float = 0.0
    overhead_s: float = 0.0  # router, sockets, HTTP: added to every TTFT and E2E
    decode_policy: str = "least_load"
    prefill_policy: str = "least_load"
    kv_growth_headroom: float = 0.1

    def __post_init__(self) -> None:
        if (self.prefill is None) != self.layout.colocated:
            raise ValueError(
                f"a PD layout needs a prefill pool and a colocated one none: {self.layout}"
            )
        for policy in (self.decode_policy, self.prefill_policy):
            if policy not in POLICIES:
                raise ValueError(f"unknown dispatch policy {policy!r}; known: {POLICIES}")
        if not self.kv_bandwidth > 0:
            raise ValueError(f"kv_bandwidth must be > 0, got {self.kv_bandwidth}")


@dataclass(frozen=True)
class RequestOutcome:
    ttft: float | None  # None: never got its first token (the run cannot end that way)
    e2e: float | None
    output_len: int

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


@dataclass(frozen=True)
class SimResult:
    outcomes: tuple[RequestOutcome, ...]
    duration: float  # first arrival -> last finish


ARRIVE, PREFILL_END, DECODE_END, TRANSFER_END = range(4)


class Simulation:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        d, p, bs = config.decode, config.prefill, config.block_size
        headroom = math.ceil(config.kv_growth_headroom * d.kv_blocks)
        self.decoders = [
            DecodeSim(d.cost, d.max_num_batched_tokens, d.max_num_seqs, d.kv_blocks, bs, headroom)
            for _ in range(config.layout.num_decode)
        ]
        self.prefillers = [
            PrefillSim(p.cost, p.max_num_batched_tokens, p.max_num_seqs, p.kv_blocks, bs)
            for _ in range(config.layout.num_prefill)
        ] if p is not None else []  # fmt: skip
        self.events: list[tuple[float, int, int, object]] = []
        self.order = itertools.count()
        self.rr = {"prefill": itertools.count(), "decode": itertools.count()}
        self.plans: dict[tuple[str, int], tuple[float, StepPlan]] = {}
        self.version = [0] * len(self.decoders)  # a cut plan's earlier end event is stale

    def push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self.events, (t, next(self.order), kind, payload))

    def run(self, requests: Sequence[SimRequest]) -> SimResult:
        jobs = [
            SimJob(i, r.arrival, r.prompt_len, r.output_len, r.group, r.prefix_len)
            for i, r in enumerate(requests)
        ]
        for job in jobs:
            self.push(job.arrival, ARRIVE, job)
        handlers = {
            ARRIVE: self._arrive,
            PREFILL_END: self._prefill_end,
            DECODE_END: self._decode_end,
            TRANSFER_END: self._transfer_end,
        }
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            handlers[kind](now, payload)
        return self._result(jobs)

    def _result(self, jobs: list[SimJob]) -> SimResult:
        o = self.config.overhead_s
        outcomes = tuple(
            RequestOutcome(
                None if j.first_token is None else j.first_token - j.arrival + o,
                None if j.finish is None else j.finish - j.arrival + o,
                j.output_len,
            )
            for j in jobs
        )
        ends = [j.finish for j in jobs if j.finish is not None]
        start = min((j.arrival for j in jobs), default=0.0)
        return SimResult(outcomes, max(ends, default=start) - start)

    # -- the router ---------------------------------------------------------------------------
    def _pick(self, pool: str, nodes: list, key) -> int:
        policy = self.config.decode_policy if pool == "decode" else self.config.prefill_policy
        if policy == "round_robin":
            return next(self.rr[pool]) % len(nodes)
        return min(range(len(nodes)), key=lambda i: (key(nodes[i]), i))

    def _arrive(self, now: float, job: SimJob) -> None:
        d = self._pick("decode", self.decoders, lambda n: (-n.free_blocks(), n.num_requests()))
        job.decode_node = d
        node = self.decoders[d]
        if self.config.layout.colocated:
            node.add_prompt(job)
        else:
            p = self._pick("prefill", self.prefillers, lambda n: n.load_tokens)
            job.prefill_node = p
            self.prefillers[p].load_tokens += job.prompt_len
            node.reservations.append(job)
        self._kick_decode(now, d)

    # -- nodes ------------------------------------------------------------------------------
    def _kick_decode(self, now: float, d: int) -> None:
        node = self.decoders[d]
        if node.busy:
            started, plan = self.plans[("decode", d)]
            if plan.steps > 1:
                node.cut(plan, now - started)
                self.version[d] += 1
                self.push(started + plan.duration, DECODE_END, (d, self.version[d]))
            return
        for job in node.reserve():
            self.prefillers[job.prefill_node].add(job)
            self._kick_prefill(now, job.prefill_node)
        plan = node.plan_step()
        if plan is not None:
            node.busy = True
            self.plans[("decode", d)] = (now, plan)
            self.version[d] += 1
            self.push(now + plan.duration, DECODE_END, (d, self.version[d]))

    def _decode_end(self, now: float, event: tuple[int, int]) -> None:
        d, version = event
        if version != self.version[d]:
            return  # the plan was cut short: a later event ends it
        node = self.decoders[d]
        _, plan = self.plans.pop(("decode", d))
        node.finish_step(plan, now)
        node.busy = False
        self._kick_decode(now, d)

    def _kick_prefill(self, now: float, p: int) -> None:
        node = self.prefillers[p]
        if node.busy:
            return
        plan = node.plan_step()
        if plan is not None:
            node.busy = True
            self.plans[("prefill", p)] = (now, plan)
            self.push(now + plan.duration, PREFILL_END, p)

    def _prefill_end(self, now: float, p: int) -> None:
        node = self.prefillers[p]
        started, plan = self.plans.pop(("prefill", p))
        for job in node.finish_step(plan):
            node.load_tokens -= job.prompt_len
            job.first_token = now
            if job.output_len == 1:  # the first token ends it: no transfer
                job.finish = now
                node.release(job)
                self.decoders[job.decode_node].cancel_reservation(job)
                self._kick_decode(now, job.decode_node)
                continue
            c = self.config
            seconds = job.prompt_len * c.kv_bytes_per_token / c.kv_bandwidth
            self.push(max(now, started + seconds) + c.transfer_latency_s, TRANSFER_END, job)
        node.busy = False
        self._kick_prefill(now, p)

    def _transfer_end(self, now: float, job: SimJob) -> None:
        self.prefillers[job.prefill_node].release(job)
        self._kick_prefill(now, job.prefill_node)
        self.decoders[job.decode_node].land(job)
        self._kick_decode(now, job.decode_node)


def simulate(config: SimConfig, requests: Sequence[SimRequest]) -> SimResult:
    return Simulation(config).run(requests)
