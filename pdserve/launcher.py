"""Run a `Plan`: check that its ports are free, start the nodes and the router, wait until
every node is healthy, print one line per node (its memory: weights, CUDA graphs and KV; KV
blocks and the concurrency they allow), then watch the processes. A port in use ends the
launch before any process starts, with one line naming its flag and exit code 2.

Ctrl-C or SIGTERM stops every process this launcher started (SIGINT, which stops a node at
once, then SIGKILL after 5 s; SIGTERM would make a node drain). A node that dies while serving
is reported and gets no more work (the router's /health shows it); with `--restart-nodes` it is
started again with the same command line (after a growing delay when it keeps exiting within
seconds of its start) and rejoins with its first heartbeat. The launcher ends when the router
itself exits. With `--router-url` it starts no router: its nodes join the router of another
host, and it waits for them to show healthy in that router's /health.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

from pdserve.plan import NodeProcess, Plan
from pdserve.ports import first_port_taken
from router.metrics import node_memory_bytes

STOP_GRACE_S = 5.0
POLL_S = 0.5
PORT_IN_USE = 2  # the exit code of every other flag error


class RestartBackoff:
    """When a node that exited may start again: at once after a run of at least `healthy_run_s`
    and after its first two quick exits in a row, then after a delay that doubles with each
    further quick exit (1 s, 2 s, ... up to `max_delay_s`), so a node that cannot start (a bad
    flag, a port in use) does not spin the host."""

    def __init__(self, healthy_run_s: float = 20.0, max_delay_s: float = 60.0) -> None:
        self.healthy_run_s = healthy_run_s
        self.max_delay_s = max_delay_s
        self._quick_exits: dict[str, int] = {}

    def delay(self, name: str, ran_s: float) -> float:
        """Seconds to wait before restarting `name`, which exited after running `ran_s`."""
        if ran_s >= self.healthy_run_s:
            self._quick_exits[name] = 0
            return 0.0
        n = self._quick_exits.get(name, 0)
        self._quick_exits[name] = n + 1
        return 0.0 if n < 2 else min(self.max_delay_s, 2.0 ** (n - 2))


class Stop(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def say(message: str) -> None:
    print(f"pdserve: {message}", file=sys.stderr, flush=True)


class Launcher:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.started_at: dict[str, float] = {}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")

    def run(self) -> int:
        taken = first_port_taken(self.plan.configs.launch, self.plan.ports)
        if taken is not None:
            say(f"error: {taken}")
            return PORT_IN_USE
        for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
            signal.signal(sig, lambda *_, code=code: self._raise(code))
        try:
            self._start_all()
            self._wait_healthy()
            self._serve()
            return 0
        except Stop as stop:
            return stop.code
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self.stop_all()

    @staticmethod
    def _raise(code: int) -> None:
        raise Stop(code)

    def _start_all(self) -> None:
        env = self.env
        cpu_only = all("cuda" not in " ".join(n.argv) for n in self.plan.nodes)
        if cpu_only and "OMP_NUM_THREADS" not in env:
            # CPU nodes share the cores: without this each process would start one torch
            # thread per core and they would fight (measured: 3x slower prefill).
            ranks = sum(n.ranks for n in self.plan.nodes)  # tensor-parallel ranks count too
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
        for node in self.plan.nodes:
            self.procs.append((node.name, subprocess.Popen(node.argv, env=env)))
            self.started_at[node.name] = time.monotonic()
        if self.plan.router_argv is not None:
            self.procs.append(("router", subprocess.Popen(self.plan.router_argv, env=env)))

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.plan.configs.launch.health_timeout
        # Serving once every node started here heartbeats, not just one of each role: a load
        # that starts right away should find the whole pool.
        mine = {node.address for node in self.plan.nodes}
        while True:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    say(f"{name} (pid {proc.pid}) exited during start-up; stopping")
                    raise Stop(1)
            health = self.health()
            nodes = health.get("nodes", []) if health else []
            if mine <= {n.get("id") for n in nodes if n.get("healthy")}:
                break
            if time.monotonic() > deadline:
                say(f"not healthy after {self.plan.configs.launch.health_timeout:g} s")
                raise Stop(1)
            time.sleep(POLL_S)
        by_address = {n["id"]: n for n in nodes}
        for node in self.plan.nodes:
            engine = self.plan.configs.engines["prefill" if node.role == "prefill" else "decode"]
            report = by_address.get(node.address, {})
            say(node_summary(node, report, engine.speculative.num_speculative_tokens))

    def _serve(self) -> None:
        launch = self.plan.configs.launch
        print(
            f"pdserve is serving {self.plan.model_name} at {self.plan.url}  (prefill: "
            f"{launch.prefill_count}, decode: {launch.num_decode}, transport: "
            f"{self.plan.configs.nodes['decode'].transport})",
            flush=True,
        )
        reported: set[str] = set()
        argv = {node.name: node.argv for node in self.plan.nodes}
        backoff = RestartBackoff()
        restart_at: dict[str, float] = {}  # exited nodes waiting out their backoff
        while True:
            now = time.monotonic()
            for i, (name, proc) in enumerate(self.procs):
                if proc.poll() is None or name in reported:
                    continue
                if name == "router":
                    say(f"router (pid {proc.pid}) exited with {proc.returncode}")
                    raise Stop(1)
                if not launch.restart_nodes:
                    say(f"{name} (pid {proc.pid}) exited with {proc.returncode}")
                    reported.add(name)
                elif name not in restart_at:
                    wait = backoff.delay(name, now - self.started_at[name])
                    say(
                        f"{name} (pid {proc.pid}) exited with {proc.returncode}; restarting"
                        + (f" in {wait:g} s" if wait else "")
                    )
                    restart_at[name] = now + wait
                elif now >= restart_at[name]:
                    del restart_at[name]
                    self.procs[i] = (name, subprocess.Popen(argv[name], env=self.env))
                    self.started_at[name] = now
                    say(f"restarted {name} (pid {self.procs[i][1].pid})")
            time.sleep(POLL_S)

    def health(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(self.plan.url + "/health", timeout=2) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # 503 while a path is missing: still a report
            try:
                return json.loads(e.read())
            except ValueError:
                return None
        except (OSError, ValueError):
            return None

    def stop_all(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # at once: SIGTERM would drain a node
        deadline = time.monotonic() + STOP_GRACE_S
        for _, proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def node_summary(node: NodeProcess, report: dict[str, Any], num_speculative: int = 0) -> str:
    """`decode-0 (pid 12, cuda:0, bfloat16): weights 15.23 GB, graphs 0.41 GB, KV 44.20 GB
    (GPU share 0.425); KV float8_e4m3fn 8192 blocks x 16 = 131072 tokens; max concurrency 64.0
    requests of 2048 tokens; speculative ngram, K 4` (an FP8 pool holds twice the tokens of one
    in the model dtype; with --tp each figure is one rank's). The speculative setting is the
    one the node reported, which its KV peers must share; K (`num_speculative`, from the
    pool's flags) may differ between pools."""
    info = report.get("info") or {}
    blocks, size = info.get("num_kv_blocks"), info.get("block_size")
    max_len = info.get("max_model_len")
    if not (isinstance(blocks, int) and isinstance(size, int) and isinstance(max_len, int)):
        return f"{node.name}: healthy (no runtime info in its heartbeat)"
    tokens = blocks * size
    memory = ", ".join(
        f"{'KV' if kind == 'kv' else kind} {n / 1e9:.2f} GB"
        for kind, n in node_memory_bytes(info).items()
    )
    if node.gpu_memory_fraction is not None:
        memory += f" (GPU share {node.gpu_memory_fraction:g})"
    tp, pp = info.get("tp") or 1, info.get("pp") or 1
    ranks = f", tp {tp}" if tp > 1 else ""
    ranks += (
        f", pp {pp} ({'+'.join(map(str, info.get('pp_layers') or ()))} layers)" if pp > 1 else ""
    )
    kv_format = info.get("kv_format") or {}
    kv_dtype = kv_format.get("kv_dtype") or info.get("dtype")
    speculative = kv_format.get("speculative") or "none"
    if speculative != "none" and num_speculative:
        speculative += f", K {num_speculative}"
    return (
        f"{node.name} (pid {info.get('pid')}, {info.get('device')}{ranks}, {info.get('dtype')}): "
        f"{memory}; KV {kv_dtype} {blocks} blocks x {size} = {tokens} "
        f"tokens; "
        f"max concurrency {tokens / max_len:.1f} requests of {max_len} tokens; "
        f"speculative {speculative}"
    )
