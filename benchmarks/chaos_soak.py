"""Chaos soak: Poisson load on the PD stack while nodes are SIGKILLed and restarted at random.

    python benchmarks/chaos_soak.py --minutes 10 --rate 0.5 --kill-every 3:8 [-- launch_pd.sh flags]

Starts `scripts/launch_pd.sh --restart-nodes` with 2 prefill and 2 decode nodes (the embedded
model on CPU unless told otherwise), sends streamed and whole completions at Poisson arrivals,
and SIGKILLs a random node of the stack every few seconds; the launcher starts it again and it
rejoins. Afterwards it waits for every node to come back and checks what must hold:
- every request ended with its full output (max_tokens tokens, `ignore_eos`) or an OpenAI
  error body, and none outlived the router's deadline by more than a grace period;
- every node holds zero used, reserved and quarantined KV blocks and no transfer;
- after the launcher stopped, no process it ever started is alive.
It prints the minutes run, requests, kills, outcomes, and each violation, leak and orphan.
`tests/test_chaos_soak.py` runs a short one.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import re
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.stack import PDStack, alive, descendants  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
GRACE_S = 30.0  # a request may end this long after the router's deadline (event loop, teardown)


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 600.0
    rate: float = 0.5  # requests per second, Poisson arrivals (a 2-core CPU box serves ~1)
    kill_every_s: tuple[float, float] = (3.0, 8.0)  # uniform gap between kills
    max_tokens: int = 8
    prompt_tokens: tuple[int, int] = (8, 64)
    request_timeout_s: float = 30.0  # the router's deadline
    transfer_deadline_s: float = 15.0
    max_waiting: int = 8  # the router's --max-waiting-requests: overload gives 429s
    kv_blocks: int | None = None  # --num-kv-blocks of every node (None: the node's default)
    settle_timeout_s: float = 300.0  # for the nodes to come back and release their blocks
    spare_last: bool = True  # never kill the last healthy node of a pool (keeps a path up)
    seed: int = 0
    extra_args: tuple[str, ...] = ()  # more launch_pd.sh flags (e.g. GPUs, a model)

    def stack_args(self) -> list[str]:
        t = str(self.transfer_deadline_s)
        return [
            "--num-prefill", "2", "--num-decode", "2", "--restart-nodes",
            "--router-request-timeout-s", str(self.request_timeout_s),
            "--router-max-waiting-requests", str(self.max_waiting),
            "--prefill-transfer-deadline-s", t, "--decode-transfer-deadline-s", t,
            *self._pool_size(), *self.extra_args,
        ]  # fmt: skip

    def _pool_size(self) -> list[str]:
        if self.kv_blocks is None:
            return []
        n = str(self.kv_blocks)
        return ["--prefill-num-kv-blocks", n, "--decode-num-kv-blocks", n]


@dataclass
class SoakReport:
    minutes: float = 0.0
    requests: int = 0
    kills: list[str] = field(default_factory=list)  # "role pid"
    outcomes: Counter[str] = field(default_factory=Counter)  # "200", or status and message
    violations: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    orphans: list[int] = field(default_factory=list)
    served_after: bool = False  # a request succeeded once every node was back

    @property
    def ok(self) -> bool:
        return not (self.violations or self.leaks or self.orphans) and self.served_after

    def summary(self) -> str:
        errors = sum(n for k, n in self.outcomes.items() if k != "200")
        return "\n".join([
            f"minutes run     {self.minutes:.2f}",
            f"requests        {self.requests} ({self.outcomes['200']} full, {errors} errors)",
            *[f"  {n:5d} x {kind}" for kind, n in self.outcomes.most_common()],
            f"kills           {len(self.kills)}",
            f"violations      {len(self.violations)}",
            f"leaks           {len(self.leaks)}",
            f"orphans         {len(self.orphans)}",
            f"served after    {self.served_after}",
            *[f"  violation: {v}" for v in self.violations[:20]],
            *[f"  leak: {v}" for v in self.leaks],
            *[f"  orphan pid: {p}" for p in self.orphans],
        ])  # fmt: skip


def one_request(url: str, prompt: list[int], stream: bool, config: SoakConfig) -> tuple[str, str]:
    """(outcome, violation or ""): the outcome is "200" for a full answer, else the error's
    HTTP status (or "stream" for an error event inside a stream)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": config.max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    limit = config.request_timeout_s + GRACE_S
    start = time.monotonic()
    try:
        with httpx.Client(timeout=limit) as http:
            if stream:
                outcome = _streamed(http, url, body, config.max_tokens)
            else:
                outcome = _whole(http.post(url + "/v1/completions", json=body), config.max_tokens)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return "broken", f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - start
    if took > limit:
        return outcome[0], f"took {took:.1f} s, past the deadline and its grace"
    return outcome


def _whole(r: httpx.Response, max_tokens: int) -> tuple[str, str]:
    body = r.json()
    if r.status_code == 200:
        tokens = body["usage"]["completion_tokens"]
        return "200", "" if tokens == max_tokens else f"200 with {tokens} of {max_tokens} tokens"
    if "error" in body and body["error"].get("message"):
        return f"{r.status_code} {_gist(body['error']['message'])}", ""
    return str(r.status_code), f"{r.status_code} without an OpenAI error body: {body}"


def _streamed(http: httpx.Client, url: str, body: dict, max_tokens: int) -> tuple[str, str]:
    finished, tokens = False, None
    with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return _whole(r, max_tokens)
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                if finished and tokens == max_tokens:
                    return "200", ""
                return "200", f"stream done with finish={finished}, {tokens} of {max_tokens} tokens"
            event = json.loads(line[6:])
            if "error" in event:
                message = event["error"].get("message")
                return f"stream {_gist(message or '')}", "" if message else f"bad error {event}"
            finished |= any(c.get("finish_reason") for c in event.get("choices") or [])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return "broken", "stream closed without [DONE] or an error event"


def _gist(message: str) -> str:
    """An error message with addresses and numbers blanked, to count errors by kind."""
    return re.sub(r"tcp://\S+|\d+(\.\d+)?", "#", message)[:60]


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (pid and start time name one process)."""
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def victims(stack: PDStack, ours: set[int], spare_last: bool) -> list[tuple[str, int]]:
    """(role, pid) of the healthy nodes this stack started that may be killed now."""
    try:
        nodes = stack.get("/health")[1]["nodes"]
    except (OSError, ValueError, KeyError):
        return []
    healthy = [n for n in nodes if n["healthy"] and n.get("pid") in ours]
    roles = Counter(n["role"] for n in healthy)
    return [(n["role"], n["pid"]) for n in healthy if not spare_last or roles[n["role"]] > 1]


def remember(stack: PDStack, seen: dict[int, int | None]) -> set[int]:
    """Record the launcher's processes as (pid, start time); returns their pids."""
    ours = set(descendants(stack.proc.pid))
    for pid in ours:
        seen.setdefault(pid, start_time(pid))
    return ours


def killer(stack: PDStack, config: SoakConfig, stop: threading.Event, report: SoakReport,
           seen: dict[int, int | None]) -> None:  # fmt: skip
    rng = random.Random(config.seed + 1)
    while not stop.wait(rng.uniform(*config.kill_every_s)):
        candidates = victims(stack, remember(stack, seen), config.spare_last)
        if not candidates:
            continue
        role, pid = rng.choice(candidates)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        report.kills.append(f"{role} {pid}")


def load(stack: PDStack, config: SoakConfig, report: SoakReport, deadline: float) -> None:
    rng = random.Random(config.seed)
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        futures = []
        while time.monotonic() < deadline:
            n = rng.randint(*config.prompt_tokens)
            prompt = [rng.randrange(1000, 30000) for _ in range(n)]
            futures.append(pool.submit(one_request, stack.url, prompt, rng.random() < 0.5, config))
            time.sleep(rng.expovariate(config.rate))
        for future in futures:
            outcome, violation = future.result()
            report.outcomes[outcome] += 1
            if violation:
                report.violations.append(violation)
    report.requests = len(futures)


def settled(stack: PDStack, expected_nodes: int) -> list[str]:
    """What still holds KV or is missing; empty once every node is back and idle."""
    status, health = stack.get("/health")
    nodes = [n for n in health["nodes"] if n["healthy"]]
    held = [] if len(nodes) >= expected_nodes else [f"{len(nodes)} of {expected_nodes} nodes up"]
    for n in nodes:
        load = n["load"]
        for key in ("used_blocks", "reserved", "quarantined", "transferring"):
            if load.get(key, 0):
                held.append(f"{n['role']} {n['id']}: {key}={load[key]}")
    return held


def run_soak(config: SoakConfig, log_path: Path) -> SoakReport:
    report = SoakReport()
    stack = PDStack(*config.stack_args(), log_path=log_path)
    seen: dict[int, int | None] = {}
    remember(stack, seen)
    stop = threading.Event()
    start = time.monotonic()
    try:
        kill_thread = threading.Thread(target=killer, args=(stack, config, stop, report, seen))
        kill_thread.start()
        try:
            load(stack, config, report, start + config.duration_s)
        finally:
            stop.set()
            kill_thread.join()
        report.minutes = (time.monotonic() - start) / 60
        try:
            stack.wait_for(lambda: not settled(stack, 4), "the nodes to settle",
                           timeout_s=config.settle_timeout_s)  # fmt: skip
        except AssertionError:
            report.leaks = settled(stack, 4)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
        r = httpx.post(stack.url + "/v1/completions", json=body, timeout=120)
        report.served_after = r.status_code == 200
        remember(stack, seen)
    finally:
        left = stack.stop()
    report.orphans = survivors(seen, set(left))
    return report


def survivors(seen: dict[int, int | None], left: set[int], grace_s: float = 15.0) -> list[int]:
    """Processes of the stack still alive `grace_s` after the launcher stopped (a process that
    was SIGKILLed a moment ago may still be tearing down its memory)."""

    def still() -> set[int]:
        ours = {p for p, t in seen.items() if t is not None and start_time(p) == t}
        return {p for p in ours | left if alive(p)}

    end = time.monotonic() + grace_s
    while still() and time.monotonic() < end:
        time.sleep(0.2)
    return sorted(still())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=0.5, help="requests/s (Poisson)")
    p.add_argument("--kill-every", default="3:8", help="MIN:MAX seconds between kills")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--request-timeout-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-last", action="store_true", help="may kill a pool's last healthy node")
    p.add_argument("--log", type=Path, default=Path("chaos_soak.log"))
    p.add_argument("launch_args", nargs="*", help="more launch_pd.sh flags, after --")
    args = p.parse_args(argv)
    lo, hi = (float(x) for x in args.kill_every.split(":"))
    config = SoakConfig(
        duration_s=args.minutes * 60, rate=args.rate, kill_every_s=(lo, hi),
        max_tokens=args.max_tokens, request_timeout_s=args.request_timeout_s, seed=args.seed,
        extra_args=tuple(args.launch_args), spare_last=not args.kill_last,
    )  # fmt: skip
    report = run_soak(config, args.log)
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
