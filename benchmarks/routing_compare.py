r"""Prefill routing policies side by side on the shared-prefix workload: prefix-cache hit rate
and TTFT, one stack per policy, the same open-loop load (benchmarks/loadgen) for each.

    python benchmarks/routing_compare.py --policies round_robin cache_aware \
        --num-prefill 2 --num-decode 2 --num-prompts 300 --request-rate 6 \
        --model benchmarks/configs/qwen2.5-7b-instruct --load-format dummy \
        --launch-arg "--prefill-gpus 0,1 --decode-gpus 2,3 --transport cuda_ipc"
    python benchmarks/routing_compare.py --cpu-small    # the embedded model on a CPU, minutes

Each policy gets a fresh stack (`scripts/launch_pd.sh ... --router-prefill-policy P`), so every
prefix cache starts empty. Policies differ when the prefixes fit the prefill pool's caches
together but not one node's (limit them with `--prefill-num-kv-blocks`): round robin makes
every node cache every prefix, cache_aware keeps each prefix on one node. The hit rate is the prefill nodes' `pdserve:prefix_cache_hits_total`
over `pdserve:prefix_cache_queries_total` (prompt tokens), counted across the measured run only.
The table at the end compares the policies; `--out` keeps everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_serving import benchmark, served_model  # noqa: E402
from benchmarks.loadgen.client import Target  # noqa: E402
from benchmarks.loadgen.runner import RunConfig  # noqa: E402
from benchmarks.stack import PDStack, same_python_env  # noqa: E402
from pdserve.workload.datasets import WorkloadConfig, build_workload  # noqa: E402

# The embedded model on 2 CPU cores: small prompts, few of them, a slow rate. Each prefill node
# caches 48 blocks: the 6 prefixes (12 blocks each) fit the pool split in two, not one node.
CPU_SMALL = {
    "num_prompts": 30, "request_rate": 1.0, "num_groups": 6, "prefix_len": 192,
    "input_len": "16:48", "output_len": "4", "launch_arg": ["--prefill-num-kv-blocks 48"],
}  # fmt: skip


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    completed: int
    failed: int
    hit_rate: float | None  # prefix-cache hits / queries over the prefill nodes, in tokens
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    ttft_mean_ms: float | None
    output_tok_s: float
    per_node: dict[str, float]  # requests dispatched to each prefill node


def prefill_counters(metrics_text: str) -> dict[str, dict[str, float]]:
    """{node: {"hits", "queries", "requests"}} of the prefill nodes, from a /metrics body."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {
        "pdserve:prefix_cache_hits_total": "hits",
        "pdserve:prefix_cache_queries_total": "queries",
        "pdserve:node_requests_total": "requests",
    }
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            key = names.get(sample.name)
            if key and sample.labels.get("role") == "prefill":
                node = out.setdefault(
                    sample.labels["node"], {"hits": 0, "queries": 0, "requests": 0}
                )
                node[key] += sample.value
    return out


def hit_rate(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> float | None:
    """Hits over queries of what happened between two scrapes (None: no query at all)."""
    hits = sum(n["hits"] for n in after.values()) - sum(n["hits"] for n in before.values())
    queries = sum(n["queries"] for n in after.values()) - sum(n["queries"] for n in before.values())
    return hits / queries if queries > 0 else None


def scrape(stack: PDStack) -> dict[str, dict[str, float]]:
    return prefill_counters(httpx.get(stack.url + "/metrics", timeout=30).text)


def run_policy(policy: str, args: argparse.Namespace, env: dict[str, str]) -> PolicyResult:
    launch = [
        "--num-prefill", str(args.num_prefill), "--num-decode", str(args.num_decode),
        "--router-prefill-policy", policy, "--health-timeout", str(args.health_timeout),
    ]  # fmt: skip
    if args.model:
        launch += ["--model", args.model]
    if args.load_format != "auto":
        launch += [
            "--prefill-load-format",
            args.load_format,
            "--decode-load-format",
            args.load_format,
        ]
    for extra in args.launch_arg:
        launch += extra.split()
    print(f"== {policy}: launch_pd.sh {' '.join(launch)}", flush=True)
    log = args.out / f"stack_{policy}.log"
    stack = PDStack(*launch, log_path=log, start_timeout_s=args.health_timeout + 60, env=env)
    try:
        target = Target(stack.url, served_model(stack.url, None))
        workload = WorkloadConfig(
            dataset="shared-prefix", num_prompts=args.num_prompts, seed=args.seed,
            input_len=args.input_len, output_len=args.output_len, num_groups=args.num_groups,
            prefix_len=args.prefix_len,
        )  # fmt: skip
        specs = build_workload(workload)
        before = scrape(stack)
        started = time.monotonic()
        out = benchmark(target, specs, RunConfig(request_rate=args.request_rate, seed=args.seed,
                                                 progress=False))  # fmt: skip
        after = scrape(stack)
        print(f"   {policy}: {time.monotonic() - started:.0f} s", flush=True)
    finally:
        stack.stop()
    s = out["summary"]
    per_node = {n: after[n]["requests"] - before.get(n, {}).get("requests", 0) for n in after}
    (args.out / f"run_{policy}.json").write_text(json.dumps(out, default=str))
    return PolicyResult(
        policy, s["completed"], s["failed"], hit_rate(before, after), s["ttft_ms"]["p50"],
        s["ttft_ms"]["p99"], s["ttft_ms"]["mean"], s["output_throughput"], per_node,
    )  # fmt: skip


def table(results: list[PolicyResult]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = [
        f"{'policy':<14}{'ok':>6}{'failed':>8}{'hit rate':>10}{'TTFT p50':>11}{'TTFT p99':>11}"
        f"{'mean':>9}{'out tok/s':>11}  requests per prefill node",
    ]
    for r in results:
        rate = "-" if r.hit_rate is None else f"{100 * r.hit_rate:.1f}%"
        split = " ".join(f"{n}" for n in (int(v) for v in r.per_node.values()))
        lines.append(
            f"{r.policy:<14}{r.completed:>6}{r.failed:>8}{rate:>10}{ms(r.ttft_p50_ms):>11}"
            f"{ms(r.ttft_p99_ms):>11}{ms(r.ttft_mean_ms):>9}{r.output_tok_s:>11.1f}  {split}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add = p.add_argument
    add("--policies", nargs="+", default=["round_robin", "cache_aware"])
    add("--num-prefill", type=int, default=2)
    add("--num-decode", type=int, default=2)
    add("--num-prompts", type=int, default=300)
    add("--request-rate", type=float, default=4.0, help="requests/s (Poisson); inf = all at once")
    add("--num-groups", type=int, default=8, help="distinct shared prefixes")
    add("--prefix-len", type=int, default=2048, help="tokens of each shared prefix")
    add("--input-len", default="64:256", help="tokens after the prefix (N or A:B)")
    add("--output-len", default="32")
    add("--seed", type=int, default=0)
    add("--model", default=None, help="HF directory or .gguf (default: the embedded model)")
    add("--load-format", default="auto", help="auto or dummy (random weights)")
    add("--health-timeout", type=int, default=900)
    add("--launch-arg", action="append", default=[],
        help="more launch_pd.sh flags, split on spaces (repeatable)")  # fmt: skip
    add("--cpu-small", action="store_true", help="small sizes for the embedded model on a CPU")
    add("--out", type=Path, default=Path("benchmarks/results/routing_compare"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cpu_small:
        for key, value in CPU_SMALL.items():
            setattr(args, key, value if key != "launch_arg" else [*value, *args.launch_arg])
    if not (args.request_rate > 0 or math.isinf(args.request_rate)):
        print("routing_compare.py: --request-rate must be > 0", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    env = same_python_env(args.out / "shim_venv")
    results = [run_policy(policy, args, env) for policy in args.policies]
    (args.out / "compare.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(f"\nshared-prefix: {args.num_prompts} prompts at {args.request_rate:g}/s, "
          f"{args.num_groups} prefixes of {args.prefix_len} tokens + {args.input_len}, "
          f"{args.num_prefill} prefill / {args.num_decode} decode nodes")  # fmt: skip
    print(table(results))
    return 0 if all(r.failed == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
