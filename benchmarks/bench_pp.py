"""Pipelined prefill on two GPUs: one `--prefill-pp 2` node against one `--prefill-tp 2` node and
against two independent single-GPU prefill nodes, each PD stack started by scripts/launch_pd.sh.

    python benchmarks/bench_pp.py --out benchmarks/results/pp     # 2 GPUs, Qwen2.5-7B dummy
    python benchmarks/bench_pp.py --smoke                         # CPU, tiny model: code paths

Layouts (prefill on GPUs 0 and 1, the one decode node on GPU 1 beside them, so no layout needs
a third GPU; KV budgets per process are fixed by flags so both pools fit on GPU 1):
- `pp2`: one prefill node of two stages (layers split evenly); each stage ships its own layers'
  KV to the decode node (stage 0 from GPU 0 over NVLink, stage 1 within GPU 1);
- `tp2`: one prefill node of two tensor-parallel ranks, each shipping its KV heads;
- `2x1`: two prefill nodes of one GPU each, the router's least-load policy between them.

Per layout, after `--warmup` requests sent at once: a closed loop of each `--concurrency` C (a
client sends its next request when its last one's first token arrives: C prompts on the prefill
pool) and an open loop of each `--rates` (Poisson), `--num-requests` each. Prompts: the same
for every layout, `--prompt-len` random token ids, distinct (no prefix-cache hits);
`--max-tokens` 2, since at 1 the router ends a request on the prefill node's first token and
aborts the decode node's part, which then reports no transfer.

What each number leaves out:
- prompt tok/s: prompt tokens / (first send -> last first token). It holds the router, HTTP and
  queueing at the prefill pool; not the stack's start, the warm-up, nor the second token. In the
  open loop it is bounded by the arrival schedule, not by the pool.
- TTFT p50/p90: the client's clock, send -> first streamed token (queueing included). The KV
  transfer is not in it: the first token leaves the prefill node before the KV has landed.
- kv_xfer: the decode node's clock, first KV frame -> every layer of every stage and rank
  landed. exposed (`kv_transfer_exposed`): KV landed - first token sampled (two processes'
  clocks, one host): the transfer not hidden behind prefill compute, which delays the first
  decode step, not TTFT. The decode node's own work (admission, one step) is in neither.
- The decode node shares GPU 1 with stage 1 / rank 1 / the second prefill node: its one step
  per request and the KV writes into its pool compete with prefill there. At C=1, `2x1` runs one
  node at a time: it is the single-GPU prefill baseline. Decode throughput is not measured.

`--check` first compares greedy tokens of PP 1 and PP 2 (fp32, CUDA graphs of each stage on
GPU) in a child process. Exit status 1 when a layout failed to start, a request failed, a
transfer went unreported, a cuda_ipc sender on GPU fell back to frames, a started process
outlived its stack, or the check differed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import queue
import random
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the repository's packages

from benchmarks.loadgen.client import RequestResult, Target, send  # noqa: E402
from benchmarks.loadgen.metrics import distribution  # noqa: E402
from benchmarks.stack import (  # noqa: E402
    PDStack,
    add_model_args,
    alive,
    resolve_load_format,
    same_python_env,
)
from pdserve.workload.arrivals import arrival_offsets  # noqa: E402
from pdserve.workload.datasets import RequestSpec  # noqa: E402

LAYOUTS = {  # launcher flags, (pp, tp) of each prefill node
    "pp2": (("--prefill-pp", "2"), [(2, 1)]),
    "tp2": (("--prefill-tp", "2"), [(1, 2)]),
    "2x1": (("--num-prefill", "2"), [(1, 1), (1, 1)]),
}
GPUS = ("--prefill-gpus", "0,1", "--decode-gpus", "1")
GIB = 1 << 30
TRANSFER = ("kv_transfer", "kv_transfer_exposed")
TINY = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 2048,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}  # fmt: skip


@dataclass(frozen=True)
class Load:
    """A closed loop of `concurrency` clients, or an open loop at `rate` requests/s."""

    concurrency: int | None = None
    rate: float | None = None

    @property
    def name(self) -> str:
        return f"C={self.concurrency}" if self.concurrency else f"{self.rate:g}/s"


class Stopped(Exception):
    """SIGTERM (`timeout`): the running stack is stopped (its processes are in their own
    session and would outlive this one) and the table of what finished is printed."""


def _stop(signum: int, frame: Any) -> None:
    raise Stopped(f"signal {signum}")


def launch_args(layout: str, args: argparse.Namespace) -> list[str]:
    out = [*LAYOUTS[layout][0], "--model", args.model, "--load-format", args.load_format]
    out += ["--dtype", args.dtype, "--transport", args.transport]
    out += ["--health-timeout", str(args.health_timeout)]
    out += ["--prefill-max-num-batched-tokens", str(args.chunk_tokens)]
    out += ["--decode-max-num-seqs", "16"]  # few sequences decode at once: fewer graphs
    if args.smoke:
        return [*out, "--device", "cpu", "--num-kv-blocks", "256"]
    for pool in ("prefill", "decode"):
        out += [f"--{pool}-kv-cache-memory-bytes", str(args.kv_gib * GIB)]
    return [*out, *GPUS]


def check_layout(layout: str, nodes: list[dict[str, Any]]) -> None:
    """Raise unless the stack's prefill pool is the layout asked for."""
    shape = [(n["pp"] or 1, n["tp"] or 1) for n in nodes if n["role"] == "prefill"]
    if shape != LAYOUTS[layout][1]:
        raise RuntimeError(f"{layout}: prefill nodes of (pp, tp) {shape}, not {LAYOUTS[layout][1]}")


# -- load --------------------------------------------------------------------------------------


def make_specs(rng: random.Random, n: int, args: argparse.Namespace) -> list[RequestSpec]:
    lo, hi = 100, args.vocab_size - 1000  # clear of the special tokens at the vocabulary's end
    return [
        RequestSpec(args.max_tokens, tuple(rng.randrange(lo, hi) for _ in range(args.prompt_len)))
        for _ in range(n)
    ]


async def drive(
    target: Target, specs: list[RequestSpec], load: Load
) -> tuple[list[RequestResult], float]:
    """Send `specs` under `load`; returns the results and first send -> last first token (s)."""
    start = time.perf_counter()
    offsets = arrival_offsets(len(specs), load.rate or float("inf"), 1.0, seed=0)
    slots = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    results = [RequestResult(i, offsets[i]) for i in range(len(specs))]
    last_first = start

    async def one(client: httpx.AsyncClient, result: RequestResult, spec: RequestSpec) -> None:
        nonlocal last_first
        if slots is not None:
            await slots.acquire()
        else:
            await asyncio.sleep(max(0.0, start + result.scheduled - time.perf_counter()))
        held = slots is not None

        def first_token(_: RequestResult) -> None:
            nonlocal held, last_first
            last_first = max(last_first, time.perf_counter())
            if held:  # the closed loop moves on at the first token: it loads the prefill pool
                held = False
                slots.release()

        result.sent = time.perf_counter() - start
        await send(client, target, spec, result, first_token)
        if held:
            slots.release()

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=target.request_timeout_s, limits=limits) as client:
        await asyncio.gather(*(one(client, r, s) for r, s in zip(results, specs, strict=True)))
    return results, last_first - start


def summarize(
    load: Load, specs: list[RequestSpec], results: list[RequestResult], span: float
) -> dict[str, Any]:
    ok = [(r, s) for r, s in zip(results, specs, strict=True) if r.success]
    tokens = sum(s.prompt_len for _, s in ok)
    row: dict[str, Any] = {
        "load": load.name, "concurrency": load.concurrency, "rate": load.rate,
        "requests": len(results), "completed": len(ok), "span_s": span,
        "errors": [r.error for r in results if not r.success],
        "prompt_tokens": tokens, "prompt_tokens_per_s": tokens / span if span > 0 else None,
        "ttft_ms": distribution(r.ttft for r, _ in ok),
    }  # fmt: skip
    timings = [r.timing or {} for r, _ in ok]
    for key in (*TRANSFER, "prefill_queue", "prefill_compute"):
        values = [t[key] for t in timings if t.get(key) is not None]
        row[f"{key}_ms"] = distribution(values)
        row[f"{key}_missing"] = len(ok) - len(values)
    row["per_request"] = [
        {"ttft": r.ttft, **{k: (r.timing or {}).get(k) for k in TRANSFER}} for r in results
    ]
    return row


# -- one layout ----------------------------------------------------------------------------------


class Stack(PDStack):
    """A `PDStack` that stops its launcher when the wait for health is cut short by `Stopped`
    (PDStack stops it only on its own timeout)."""

    def _wait_ready(self, timeout_s: float) -> None:
        self.pids: list[int] = []  # set by PDStack once healthy; `stop` reads it
        try:
            super()._wait_ready(timeout_s)
        except Stopped:
            self.stop()
            raise


def run_layout(layout: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    launch = launch_args(layout, args)
    print(f"== {layout}: launch_pd.sh {shlex.join(launch)}", flush=True)
    log_path = args.out / f"{layout}.log"
    started = time.monotonic()
    stack = Stack(*launch, log_path=log_path, start_timeout_s=args.health_timeout + 60, env=env)
    out: dict[str, Any] = {"launch_args": launch, "runs": []}
    try:
        out["start_s"] = time.monotonic() - started
        keys = ("pid", "device", "tp", "pp", "pp_layers", "num_kv_blocks")
        out["nodes"] = [
            {"role": n["role"], **{k: n["info"].get(k) for k in keys}}
            for n in stack.get("/health")[1]["nodes"]
        ]
        check_layout(layout, out["nodes"])
        model = stack.get("/v1/models")[1]["data"][0]["id"]
        target = Target(stack.url, model)
        rng = random.Random(args.seed)  # the same prompts for every layout
        if args.warmup:  # at once, so that least-load reaches both nodes of 2x1
            warm = make_specs(rng, args.warmup, args)
            asyncio.run(drive(target, warm, Load(concurrency=args.warmup)))
        loads = [Load(concurrency=c) for c in args.concurrency]
        for load in loads + [Load(rate=r) for r in args.rates]:
            specs = make_specs(rng, args.num_requests, args)
            row = summarize(load, specs, *asyncio.run(drive(target, specs, load)))
            out["runs"].append(row)
            print(f"   {load.name}: {row_line(row)}", flush=True)
    finally:
        left = stack.stop()
        deadline = time.monotonic() + 30  # rank processes exit once they see their node gone
        while left and time.monotonic() < deadline:
            time.sleep(0.3)
            left = [p for p in left if alive(p)]
        out["left_alive"] = left
    out["kv_routes"] = [  # cuda_ipc senders log per receiver whether they write its pool
        line.split("cuda_ipc: ", 1)[1]
        for line in log_path.read_text().splitlines()
        if "cuda_ipc: KV to" in line
    ]
    return out


def problems(layout: str, data: dict[str, Any], args: argparse.Namespace) -> list[str]:
    if "error" in data:
        return [f"{layout}: {data['error'].splitlines()[0]}"]
    out = []
    if data["left_alive"]:
        out.append(f"{layout}: processes {data['left_alive']} outlived the stack")
    if not args.smoke and args.transport == "cuda_ipc":  # else the numbers are zmq frames'
        out += [f"{layout}: {r}" for r in data["kv_routes"] if "straight into" not in r]
    for row in data["runs"]:
        where = f"{layout} {row['load']}"
        if row["completed"] < row["requests"]:
            out.append(
                f"{where}: {row['requests'] - row['completed']} failed: {sorted(set(row['errors']))[:3]}"
            )
        if args.max_tokens > 1 and row["kv_transfer_missing"]:
            out.append(f"{where}: {row['kv_transfer_missing']} requests reported no transfer")
    return out


# -- greedy check ----------------------------------------------------------------------------------


def greedy_tokens(args: argparse.Namespace, pp: int) -> list[list[int]]:
    from common import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 1000) for _ in range(n)] for n in (5, 33, 130, 511)]
    device = "cpu" if args.smoke else "cuda:" + ",".join(map(str, range(pp)))
    with LLM(args.model, load_format="dummy", dtype="float32", pp=pp, device=device,
             num_kv_blocks=256 if args.smoke else 1024, max_num_seqs=8,
             max_num_batched_tokens=256) as llm:  # fmt: skip
        return [o.token_ids for o in llm.generate(prompts, params)]


def _check_into(args: argparse.Namespace, results: Any) -> None:
    one, two = greedy_tokens(args, 1), greedy_tokens(args, 2)
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
                  for x, y in zip(one, two, strict=True)]  # fmt: skip
    results.put({"equal": one == two, "first_difference": first_diff, "pp1": one, "pp2": two})


def check_in_child(args: argparse.Namespace) -> dict[str, Any]:
    """Greedy PP 1 == PP 2, in a child: this process then holds no GPU memory during stacks."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_check_into, args=(args, results))
    child.start()
    try:
        result = results.get(timeout=900)
    except queue.Empty:  # the child died (its traceback is above) or hung
        result = {"equal": False, "error": f"the check process ended with {child.exitcode}"}
    finally:
        child.join(timeout=60)
    return result


# -- report ----------------------------------------------------------------------------------------


def _ms(dist: dict[str, Any], q: str, width: int) -> str:
    value = dist.get(q)
    return f"{value:{width}.1f}" if value is not None else f"{'-':>{width}}"


def row_line(row: dict[str, Any]) -> str:
    rate = row["prompt_tokens_per_s"]
    return (
        f"{row['completed']:>3}/{row['requests']:<3} {rate or 0:11.0f} "
        f"{_ms(row['ttft_ms'], 'p50', 8)} {_ms(row['ttft_ms'], 'p90', 8)} "
        f"{_ms(row['kv_transfer_ms'], 'p50', 8)} {_ms(row['kv_transfer_exposed_ms'], 'p50', 8)} "
        f"{_ms(row['kv_transfer_exposed_ms'], 'p90', 8)}"
    )


def print_table(result: dict[str, Any]) -> None:
    a = result["args"]
    print(f"\n{a['prompt_len']}-token prompts, {a['num_requests']} requests a load, "
          f"max_tokens {a['max_tokens']}; times in ms")  # fmt: skip
    print(f"{'layout':<6} {'load':>7} {'ok':>7} {'prompt tok/s':>11} {'TTFT p50':>8} "
          f"{'p90':>8} {'xfer p50':>8} {'exp p50':>8} {'exp p90':>8}")  # fmt: skip
    for layout, data in result["layouts"].items():
        if "error" in data:
            print(f"{layout:<6} FAILED: {data['error'].splitlines()[0]}")
            continue
        for row in data["runs"]:
            print(f"{layout:<6} {row['load']:>7} {row_line(row)}")
    rates = {
        (layout, row["load"]): row["prompt_tokens_per_s"]
        for layout, data in result["layouts"].items()
        for row in data.get("runs", [])
    }
    for (layout, load), value in rates.items():
        if layout != "pp2" or not value:
            continue
        ratios = [f"/ {o} {value / rates[(o, load)]:.2f}" for o in ("tp2", "2x1")
                  if rates.get((o, load))]  # fmt: skip
        if ratios:
            print(f"pp2 prompt tok/s at {load}: {' '.join(ratios)}")
    if result.get("check") is not None:
        print(f"greedy PP1 == PP2 (fp32): {result['check']['equal']}")
    for line in result["problems"]:
        print("PROBLEM:", line)


# -- main --------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--num-requests", type=int, default=24, help="per load")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 4], help="closed loops")
    ap.add_argument("--rates", type=float, nargs="*", default=[6.0], help="open loops, req/s")
    ap.add_argument("--warmup", type=int, default=4, help="requests sent at once, not measured")
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--chunk-tokens", type=int, default=2048, help="prefill token budget a step")
    ap.add_argument("--kv-gib", type=int, default=16, help="KV pool of each GPU process")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--transport", default="cuda_ipc")
    ap.add_argument("--check", action="store_true", help="greedy PP1 == PP2 first (fp32)")
    add_model_args(ap, "config directory (dummy weights)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, 200-token prompts")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/pp")
    args = ap.parse_args()
    if args.smoke:
        folder = args.out / "tiny_model"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(TINY))
        args.model, args.load_format, args.dtype = str(folder), "dummy", "float32"
        args.prompt_len, args.num_requests, args.concurrency, args.rates = 200, 3, [2], [4.0]
        args.warmup, args.chunk_tokens, args.health_timeout = 2, 64, 120
    resolve_load_format(args)
    args.vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    sizes = [args.prompt_len, args.num_requests, args.max_tokens, args.chunk_tokens]
    if min(sizes + args.concurrency) < 1 or args.vocab_size < 2000:
        ap.error(f"--prompt-len, --num-requests, --max-tokens, --chunk-tokens {sizes} and "
                 f"--concurrency {args.concurrency} must be >= 1, the vocabulary "
                 f"({args.vocab_size}) >= 2000 tokens")  # fmt: skip
    return args


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, _stop)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "check": check_in_child(args) if args.check else None,
        "layouts": {},
        "problems": [],
    }
    path = args.out / "pp.json"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdserve-python-") as shim:
        env = same_python_env(Path(shim))  # the stack runs with this very interpreter
        for layout in args.layouts:
            stopped = False
            try:
                data = run_layout(layout, args, env)
            except Exception as exc:  # one layout failing to start must not lose the others
                print(f"   {layout} FAILED: {exc}", flush=True)
                data = {"error": f"{type(exc).__name__}: {exc}"}
                stopped = isinstance(exc, Stopped)
            result["layouts"][layout] = data
            result["problems"] += problems(layout, data, args)
            path.write_text(json.dumps(result, indent=1))  # partial results survive a timeout
            if stopped:
                break
    if result["check"] is not None and not result["check"]["equal"]:
        result["problems"].append("greedy PP2 differs from PP1")
    result["seconds"] = time.monotonic() - started
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    print_table(result)
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
