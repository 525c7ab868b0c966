"""Open-loop load: requests leave on a precomputed arrival schedule, whatever the server does.

Inter-arrival times are gamma distributed with shape `burstiness` and mean 1 / rate (shape 1
is a Poisson process; below 1 burstier, above 1 more regular); rate `inf` sends everything at
once. `max_concurrency` caps the requests in flight (a request waits for a slot; that wait is
reported and not counted in its TTFT). The schedule is fixed by the seed before the first send.

The sender can be split over several client processes (`client_processes`): request i goes to
process i mod K, and each process sends its share at the same absolute times (the monotonic
clock is one clock for every process of a host), so the schedule is unchanged while the
parsing of many concurrent streams no longer competes for one interpreter.

Two rules can end a run before every request finished, so that an overloaded rate point of a
sweep does not cost minutes: `drain_timeout_s` (in-flight requests are cancelled that long
after the last scheduled arrival) and `stop_when_missed` (once more requests missed the SLO
than the attainment target allows, the point has failed: nothing more is sent and in-flight
requests are cancelled). Cancelled and unsent requests count as failed.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import sys
import threading
import time
from dataclasses import dataclass
from queue import Empty

import httpx

from benchmarks.loadgen.client import RequestResult, Target, send
from pdserve.workload.arrivals import arrival_offsets
from pdserve.workload.datasets import RequestSpec
from pdserve.workload.slo import SLO

START_DELAY_S = 0.5  # client processes start, then all begin at one shared moment
KEEP_ALIVE_S = 2.0  # idle client connections close after this (see _send_all)


@dataclass(frozen=True)
class StopRule:
    """Stop a run once more than `allowed_misses` requests missed `slo`."""

    slo: SLO
    allowed_misses: int

    @classmethod
    def for_attainment(cls, slo: SLO, attainment: float, planned: int) -> StopRule:
        if not 0 < attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {attainment}")
        return cls(slo, math.floor((1 - attainment) * planned + 1e-9))


@dataclass(frozen=True)
class RunConfig:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    client_processes: int = 1
    drain_timeout_s: float | None = None
    stop_when_missed: StopRule | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.client_processes < 1:
            raise ValueError(f"client_processes must be >= 1, got {self.client_processes}")


@dataclass
class RunResult:
    results: list[RequestResult]
    duration_s: float  # first scheduled send -> last request ended
    stopped_early: bool


class _Shared:
    """Counters every client process updates (progress, SLO misses) and the stop flag."""

    def __init__(self, ctx) -> None:
        self.sent = ctx.Value("i", 0)
        self.done = ctx.Value("i", 0)
        self.failed = ctx.Value("i", 0)
        self.missed = ctx.Value("i", 0)
        self.stop = ctx.Event()

    @staticmethod
    def bump(counter, by: int = 1) -> int:
        with counter.get_lock():
            counter.value += by
            return counter.value


def run(target: Target, specs: list[RequestSpec], config: RunConfig) -> RunResult:
    offsets = arrival_offsets(len(specs), config.request_rate, config.burstiness, config.seed)
    ctx = mp.get_context("spawn")
    shared = _Shared(ctx)
    k = min(config.client_processes, len(specs))
    shares = [[(i, offsets[i], specs[i]) for i in range(p, len(specs), k)] for p in range(k)]
    concurrency = None
    if config.max_concurrency is not None:
        concurrency = max(1, -(-config.max_concurrency // k))  # split the cap over processes
    start_at = time.monotonic() + (START_DELAY_S if k > 1 else 0.05)
    progress = _Progress(shared, len(specs)) if config.progress else None
    try:
        if k == 1:
            rows = _worker(target, shares[0], start_at, config, concurrency, shared, None)
        else:
            rows = _in_processes(ctx, target, shares, start_at, config, concurrency, shared)
    finally:
        if progress is not None:
            progress.close()
    results = sorted((RequestResult.from_dict(r) for r in rows), key=lambda r: r.index)
    ends = [r.sent + r.e2e for r in results if r.sent is not None and r.e2e is not None]
    ends += [r.sent for r in results if r.sent is not None]
    duration = max(ends, default=0.0)
    return RunResult(results, duration, shared.stop.is_set())


def _in_processes(ctx, target, shares, start_at, config, concurrency, shared) -> list[dict]:
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker, args=(target, share, start_at, config, concurrency, shared, queue)
        )
        for share in shares
    ]
    for p in procs:
        p.start()
    rows: list[dict] = []
    received = 0
    while received < len(procs):
        try:
            rows += queue.get(timeout=1.0)
            received += 1
        except Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                shared.stop.set()
                raise RuntimeError(
                    f"a client process failed (exit code {dead[0].exitcode})"
                ) from None
    for p in procs:
        p.join()
    return rows


def _worker(target, share, start_at, config, concurrency, shared, queue) -> list[dict]:
    rows = asyncio.run(_send_all(target, share, start_at, config, concurrency, shared))
    if queue is not None:
        queue.put(rows)
    return rows


async def _send_all(target, share, start_at, config, concurrency, shared) -> list[dict]:
    rule = config.stop_when_missed
    # Idle connections expire here before any server's keep-alive closes them (uvicorn: 5 s by
    # default): a request sent on a connection the server is closing fails with a ReadError.
    limits = httpx.Limits(
        max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEP_ALIVE_S
    )
    timeout = httpx.Timeout(target.request_timeout_s, connect=30.0)
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    results = [RequestResult(index=i, scheduled=offset) for i, offset, _ in share]
    missed: set[int] = set()

    def miss(r: RequestResult) -> None:
        if rule is None or r.index in missed:
            return
        missed.add(r.index)
        if _Shared.bump(shared.missed) > rule.allowed_misses:
            shared.stop.set()

    async def one(client: httpx.AsyncClient, result: RequestResult, spec: RequestSpec) -> None:
        waited = time.monotonic()
        if slots is not None:
            await slots.acquire()
        try:
            result.sent = time.monotonic() - start_at
            result.queue_wait = time.monotonic() - waited
            _Shared.bump(shared.sent)
            watchdog = None
            if rule is not None and rule.slo.ttft_ms is not None:
                loop = asyncio.get_running_loop()
                watchdog = loop.call_later(
                    rule.slo.ttft_ms / 1000,
                    lambda: miss(result) if result.ttft is None else None,
                )
            on_first = (
                (lambda r: miss(r) if rule.slo.ttft_missed(r.ttft) else None) if rule else None
            )
            await send(client, target, spec, result, on_first)
            if watchdog is not None:
                watchdog.cancel()
        except asyncio.CancelledError:
            result.error = result.error or "cancelled: the run ended first"
            result.success = False
        finally:
            if slots is not None:
                slots.release()
            _Shared.bump(shared.done if result.success else shared.failed)
            if rule is not None and not rule.slo.met(result):
                miss(result)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        tasks = []
        for result, (_, offset, spec) in zip(results, share, strict=True):
            delay = start_at + offset - time.monotonic()
            if delay > 0:
                await _sleep_unless_stopped(delay, shared)
            if shared.stop.is_set():
                break
            tasks.append(asyncio.ensure_future(one(client, result, spec)))
        for result in results[len(tasks) :]:
            result.error = "not sent: the run stopped early (too many SLO misses)"
        await _drain(tasks, start_at, share, config, shared)
    return [r.to_dict() for r in results]


async def _sleep_unless_stopped(delay: float, shared: _Shared) -> None:
    end = time.monotonic() + delay
    while (left := end - time.monotonic()) > 0 and not shared.stop.is_set():
        await asyncio.sleep(min(left, 0.05))


async def _drain(tasks, start_at, share, config, shared) -> None:
    """Wait for in-flight requests; cancel them on the stop flag or the drain deadline."""
    deadline = None
    if config.drain_timeout_s is not None and share:
        deadline = start_at + share[-1][1] + config.drain_timeout_s
    pending = {t for t in tasks if not t.done()}
    while pending:
        if shared.stop.is_set() or (deadline is not None and time.monotonic() > deadline):
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            return
        _, pending = await asyncio.wait(pending, timeout=0.1)


class _Progress:
    """One status line on stderr: rewritten in place on a terminal, every 10 s in a log."""

    def __init__(self, shared: _Shared, total: int) -> None:
        self.shared, self.total = shared, total
        self.tty = sys.stderr.isatty()
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _line(self) -> str:
        s = self.shared
        return (
            f"[{time.monotonic() - self.started:6.1f}s] sent {s.sent.value}/{self.total}"
            f"  done {s.done.value}  failed {s.failed.value}  slo-missed {s.missed.value}"
        )

    def _loop(self) -> None:
        period = 0.5 if self.tty else 10.0
        while not self._stop.wait(period):
            sys.stderr.write(("\r" if self.tty else "") + self._line() + ("" if self.tty else "\n"))
            sys.stderr.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        sys.stderr.write(("\r" if self.tty else "") + self._line() + "\n")
        sys.stderr.flush()
