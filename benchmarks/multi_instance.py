"""Several prefill and decode processes on one multi-GPU host, started by launch_pd.sh, under
concurrent load through the router, KV over CUDA IPC; next to smaller layouts on the same GPUs.

    python benchmarks/multi_instance.py [--layouts 1x1 2x2] [--transport cuda_ipc] \\
        [--concurrency 64] [--requests-per-client 2] [--prompt-tokens 1024] [--max-tokens 128]
    python benchmarks/multi_instance.py --cpu --model '' --transport zmq --concurrency 4 \
        --requests-per-client 1 --prompt-tokens 32 --max-tokens 8     # no GPU: a smoke run

Layout PxD: P prefill processes on GPUs 0..P-1 and D decode processes on GPUs P..P+D-1, one GPU
each, every pool with its own options (prefill token budget, decode batch size). Default model:
dummy Qwen2.5-7B weights, token-id prompts (random, fixed seed, no prefix-cache hits),
`ignore_eos`, streamed. Per layout, after an untimed warm-up that reaches every node:
  - output tokens/s, and the client's TTFT and inter-token latency medians;
  - requests each node served (the router's pdserve:node_requests_total);
  - KV routes the prefill nodes logged: direct CUDA IPC writes, or the frames fallback;
  - the nodes' KV blocks still held once the load ended (reserved, used, in transfer).
A layout passes when every request returned max_tokens tokens, every node served requests,
every KV route was direct (cuda_ipc) and no node still holds blocks.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the repository's packages

from benchmarks.bench_serving import benchmark  # noqa: E402
from benchmarks.loadgen.client import Target  # noqa: E402
from benchmarks.loadgen.runner import RunConfig  # noqa: E402
from benchmarks.outputs import args_record  # noqa: E402
from benchmarks.stack import (  # noqa: E402
    PDStack,
    add_model_args,
    resolve_load_format,
    same_python_env,
)
from pdserve.workload.datasets import WorkloadConfig, build_workload  # noqa: E402

NODE_REQUESTS = re.compile(
    r'^pdserve:node_requests_total\{[^}]*node="([^"]+)",role="([^"]+)"\} (\S+)$', re.M
)


def parse_layout(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if not match or min(int(match[1]), int(match[2])) < 1:
        raise argparse.ArgumentTypeError(f"layout {text!r} is not PxD with P, D >= 1")
    return int(match[1]), int(match[2])


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def launch_args(prefill: int, decode: int, args: argparse.Namespace) -> list[str]:
    gpus = ",".join
    out = ["--num-prefill", str(prefill), "--num-decode", str(decode)]
    if not args.cpu:
        out += [
            "--prefill-gpus", gpus(str(g) for g in range(prefill)),
            "--decode-gpus", gpus(str(g) for g in range(prefill, prefill + decode)),
        ]  # fmt: skip
    out += [
        "--transport", args.transport, "--health-timeout", str(args.health_timeout),
        "--prefill-max-num-batched-tokens", str(args.prefill_budget),
        "--decode-max-num-seqs", str(args.decode_max_seqs),
    ]  # fmt: skip
    for role in ("prefill", "decode"):
        out += [f"--{role}-kv-memory-fraction", "0.8"]
        if args.load_format != "auto":
            out += [f"--{role}-load-format", args.load_format]
    return out + (["--model", args.model] if args.model else [])


def node_requests(stack: PDStack) -> dict[str, int]:
    """Requests dispatched so far, per node, from the router's /metrics."""
    with urllib.request.urlopen(stack.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {f"{role} {node}": int(float(n)) for node, role, n in NODE_REQUESTS.findall(text)}


HELD = {"decode": ("used_blocks", "reserved", "quarantined"), "prefill": ("transferring",)}


def held_blocks(stack: PDStack) -> dict[str, dict[str, int]]:
    """Per node, the load figures that must return to 0 once no request is in flight."""
    return {
        f"{n['role']} {n['id']}": {k: (n.get("load") or {}).get(k, -1) for k in HELD[n["role"]]}
        for n in stack.get("/health")[1]["nodes"]
    }


def closed_loop(
    url: str, model: str, clients: int, requests: int, prompt: int, output: int, seed: int
) -> dict[str, Any]:
    """`requests` requests, `clients` in flight at a time; the figures print_table shows."""
    specs = build_workload(
        WorkloadConfig("random", requests, seed, input_len=str(prompt), output_len=str(output))
    )
    config = RunConfig(max_concurrency=clients, seed=seed, progress=False)
    out = benchmark(Target(url, model), specs, config)
    summary = out["summary"]
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors']}")
    return {
        "concurrency": clients,
        "requests": summary["completed"],
        "output_tokens": summary["total_output_tokens"],
        "wall_s": summary["duration_s"],
        "output_tokens_per_s": summary["output_throughput"],
        "ttft_median_s": summary["ttft_ms"]["p50"] / 1e3,
        "itl_median_s": summary["itl_ms"]["p50"] / 1e3,
        "itl_p99_s": summary["itl_ms"]["p99"] / 1e3,
    }


def run_layout(prefill: int, decode: int, args: argparse.Namespace, env: dict) -> dict[str, Any]:
    name = f"{prefill}x{decode}"
    launch = launch_args(prefill, decode, args)
    print(f"== {name}: launch_pd.sh {' '.join(launch)}", flush=True)
    log_path = args.out / f"{name}.log"
    started = time.monotonic()
    stack = PDStack(*launch, log_path=log_path, start_timeout_s=args.health_timeout + 60, env=env)
    try:
        print(f"   healthy after {time.monotonic() - started:.0f} s", flush=True)
        model = stack.get("/v1/models")[1]["data"][0]["id"]
        devices = {f"{n['role']} {n['id']}": n["device"] for n in stack.get("/health")[1]["nodes"]}
        warm = 2 * prefill * decode  # enough concurrent requests to reach every node
        closed_loop(stack.url, model, warm, warm, args.prompt_tokens, 8, args.seed + 1)
        before = node_requests(stack)
        level = closed_loop(
            stack.url, model, args.concurrency, args.concurrency * args.requests_per_client,
            args.prompt_tokens, args.max_tokens, args.seed,
        )  # fmt: skip
        after = node_requests(stack)
        served = {node: after.get(node, 0) - before.get(node, 0) for node in devices}
        zeros = {node: {k: 0 for k in held} for node, held in held_blocks(stack).items()}
        try:  # loads refresh with heartbeats: give them a few
            stack.wait_for(lambda: held_blocks(stack) == zeros, "nodes to release", 30)
        except AssertionError:
            pass
        held = held_blocks(stack)
    finally:
        left = stack.stop()
        print(f"   stopped{'; STILL ALIVE: ' + str(left) if left else ''}", flush=True)
    log = log_path.read_text()
    direct = sorted(set(re.findall(r"cuda_ipc: KV to (\S+) is written straight", log)))
    frames = sorted(set(re.findall(r"cuda_ipc: KV to (\S+) goes as frames", log)))
    expected_tokens = level["requests"] * args.max_tokens
    checks = {
        "all tokens": level["output_tokens"] == expected_tokens,
        "every node served": all(n > 0 for n in served.values()),
        "no blocks held": held == zeros,
    }
    if args.transport == "cuda_ipc":
        checks["every route direct"] = not frames and len(direct) == decode
    return {
        "layout": name,
        "launch_args": launch,
        "devices": devices,
        "level": level,
        "served": served,
        "held_after": held,
        "direct_routes": direct,
        "frames_routes": frames,
        "checks": checks,
        "passed": all(checks.values()),
    }


def print_table(result: dict[str, Any]) -> None:
    a = result["args"]
    print(
        f"\n{a['concurrency']} clients x {a['requests_per_client']} requests, "
        f"{a['prompt_tokens']}-token prompts, {a['max_tokens']} output tokens, {a['transport']}"
    )
    print(f"{'layout':>6} {'requests':>8} {'out tok/s':>10} {'TTFT p50 ms':>12} {'ITL p50 ms':>11}")
    base = None
    for r in result["layouts"]:
        lv = r["level"]
        base = base or lv["output_tokens_per_s"]
        print(
            f"{r['layout']:>6} {lv['requests']:>8} {lv['output_tokens_per_s']:>10.1f} "
            f"{lv['ttft_median_s'] * 1e3:>12.1f} {(lv['itl_median_s'] or 0) * 1e3:>11.1f}"
            f"   x{lv['output_tokens_per_s'] / base:.2f} of the first layout"
        )
    for r in result["layouts"]:
        print(f"\n{r['layout']}: {'PASS' if r['passed'] else 'FAIL'} {r['checks']}")
        for node, count in r["served"].items():
            print(
                f"  {node} on {r['devices'][node]}: {count} requests, held {r['held_after'][node]}"
            )
        print(f"  direct KV routes: {r['direct_routes']}; frames fallbacks: {r['frames_routes']}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layouts", type=parse_layout, nargs="+", default=[(1, 1), (2, 2)])
    ap.add_argument("--transport", choices=["cuda_ipc", "zmq"], default="cuda_ipc")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prefill-budget", type=int, default=8192, help="prefill token budget")
    ap.add_argument("--decode-max-seqs", type=int, default=64, help="decode batch size")
    add_model_args(ap, "model directory; '' = the embedded SmolLM2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="no GPU: every process on the CPU")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/multi_instance")
    args = ap.parse_args()
    resolve_load_format(args)
    return args


def main() -> None:
    args = parse_args()
    gpus = gpu_count()
    for prefill, decode in args.layouts:
        if not args.cpu and prefill + decode > gpus:
            sys.exit(f"layout {prefill}x{decode} needs {prefill + decode} GPUs; {gpus} visible")
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "args": args_record(args),
        "gpus": gpus,
        "layouts": [],
    }
    with tempfile.TemporaryDirectory() as shim:
        env = same_python_env(Path(shim))
        for prefill, decode in args.layouts:
            result["layouts"].append(run_layout(prefill, decode, args, env))
            (args.out / "multi_instance.json").write_text(json.dumps(result, indent=1))
    print_table(result)
    if not all(r["passed"] for r in result["layouts"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
