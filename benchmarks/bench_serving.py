"""Open-loop serving benchmark for any OpenAI-compatible server (pdserve, vLLM, SGLang).

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 \\
        --dataset long-prompt --num-prompts 200 --request-rate 4 \\
        --goodput ttft:3000 tpot:20 --result-dir results/ --label pd_2p2d

Requests leave on a Poisson (or gamma, `--burstiness`) schedule fixed by `--seed`, streamed
with `stream_options.include_usage`, as `vllm bench serve` sends them. Reported: TTFT, TPOT,
ITL and E2E latency (mean, p50/p90/p95/p99), request and token throughput, goodput and SLO
attainment for `--goodput`, failed requests by cause, the client's own send lag, and with
pdserve the p50/p99 of every phase of the servers' timing records. Writes `LABEL.json` (summary
and every request) and `LABEL.png` (latency CDFs, ITL over time) into `--result-dir`.
Datasets: see benchmarks/loadgen/workloads.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script: the repository's packages

from benchmarks.loadgen.client import ENDPOINTS, RequestResult, Target  # noqa: E402
from benchmarks.loadgen.metrics import SLO, server_phases, summarize  # noqa: E402
from benchmarks.loadgen.report import plot_run, summary_table, write_json  # noqa: E402
from benchmarks.loadgen.runner import RunConfig, StopRule, run  # noqa: E402
from pdserve.workload.datasets import (  # noqa: E402
    DATASETS,
    RequestSpec,
    WorkloadConfig,
    build_workload,
)


def benchmark(
    target: Target, specs: list[RequestSpec], config: RunConfig, slo: SLO | None = None
) -> dict[str, Any]:
    """Run one load and return {summary, server_phases, requests, stopped_early}."""
    outcome = run(target, specs, config)
    return {
        "summary": summarize(outcome.results, outcome.duration_s, slo),
        "server_phases": server_phases(outcome.results),
        "stopped_early": outcome.stopped_early,
        "requests": [r.to_dict() for r in outcome.results],
    }


def warm_up(target: Target, specs: list[RequestSpec], count: int) -> None:
    """`count` requests at once, outside the measurement (compilation, first-use costs)."""
    if count <= 0:
        return
    short = [RequestSpec(min(s.output_len, 16), s.prompt_token_ids, s.prompt) for s in specs]
    outcome = run(target, short[:count], RunConfig(progress=False))
    failed = [r.error for r in outcome.results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {count} warm-up requests failed: {failed[0]}")


def served_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"the request rate must be > 0 or inf, got {text}")
    return value


def id_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected LO:HI, got {text!r}")
    return int(lo), int(hi)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = p.add_argument
    add("--base-url", "--url", dest="base_url", default="http://127.0.0.1:8000")
    add("--endpoint", choices=sorted(ENDPOINTS), default="completions")
    add("--model", default=None, help="default: the server's first model in /v1/models")
    add("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    add("--dataset", choices=DATASETS, default="random")
    add("--dataset-path", default=None, help="JSONL trace (overrides --dataset)")
    add("--num-prompts", type=int, default=100)
    add("--duration", type=float, default=None, help="seconds of arrivals: sets --num-prompts")
    add("--seed", type=int, default=0)
    add("--input-len", default=None, help="N, A:B or lognormal:MEDIAN:SIGMA:LO:HI")
    add("--output-len", default=None, help="same forms as --input-len")
    add("--text-prompts", action="store_true", help="words instead of token ids (chat needs it)")
    add("--token-id-range", type=id_range, default=(1000, 30000))
    add("--num-groups", type=int, default=8, help="shared-prefix: distinct system prompts")
    add("--prefix-len", type=int, default=2048, help="shared-prefix: system prompt length")
    add("--request-rate", type=rate, default=math.inf, help="requests/s (Poisson); inf = all")
    add("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    add("--max-concurrency", type=int, default=None)
    add("--client-processes", type=int, default=1)
    add("--goodput", nargs="+", default=[], metavar="KEY:MS", help="ttft:MS tpot:MS e2el:MS")
    add("--attainment", type=float, default=None, help="with --goodput: stop once it is missed")
    add(
        "--drain-timeout",
        type=float,
        default=None,
        help="cancel what is left this long after the last arrival",
    )
    add("--warmup-requests", type=int, default=0)
    add("--temperature", type=float, default=0.0)
    add("--no-ignore-eos", dest="ignore_eos", action="store_false")
    add("--extra-body", type=json.loads, default={}, help="JSON merged into every request")
    add("--request-timeout", type=float, default=600.0)
    add("--result-dir", type=Path, default=None)
    add("--label", default=None, help="file name stem (default: dataset and rate)")
    add("--no-progress", dest="progress", action="store_false")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    num = args.num_prompts
    if args.duration is not None and not math.isinf(args.request_rate):
        num = max(1, math.ceil(args.request_rate * args.duration))
    try:
        slo = SLO.parse(args.goodput)
        workload = WorkloadConfig(
            dataset=args.dataset, num_prompts=num, seed=args.seed, input_len=args.input_len,
            output_len=args.output_len, text=args.text_prompts or args.endpoint == "chat",
            token_id_range=args.token_id_range, num_groups=args.num_groups,
            prefix_len=args.prefix_len, dataset_path=args.dataset_path,
        )  # fmt: skip
        specs = build_workload(workload)
        stop = None
        if args.attainment is not None:
            if not slo:
                raise ValueError("--attainment needs --goodput")
            stop = StopRule.for_attainment(slo, args.attainment, len(specs))
        config = RunConfig(
            request_rate=args.request_rate, burstiness=args.burstiness,
            max_concurrency=args.max_concurrency, seed=args.seed,
            client_processes=args.client_processes, drain_timeout_s=args.drain_timeout,
            stop_when_missed=stop, progress=args.progress,
        )  # fmt: skip
    except ValueError as exc:
        print(f"bench_serving.py: {exc}", file=sys.stderr)
        return 2
    model = args.model or served_model(args.base_url, args.api_key)
    target = Target(
        args.base_url, model, args.endpoint, args.ignore_eos, args.temperature,
        args.extra_body, args.api_key, args.request_timeout,
    )  # fmt: skip
    warm_up(target, build_workload(WorkloadConfig(**{**vars(workload), "seed": args.seed + 1})),
            args.warmup_requests)  # fmt: skip
    started = time.time()
    out = benchmark(target, specs, config, slo)
    out["config"] = {**vars(args), "result_dir": str(args.result_dir), "num_prompts": num}
    out["config"]["token_id_range"] = list(args.token_id_range)
    out["model"], out["started_unix"] = model, started
    print(summary_table(out["summary"], out["server_phases"]))
    if args.result_dir is not None:
        label = args.label or f"{args.dataset}_rate{args.request_rate:g}"
        write_json(args.result_dir / f"{label}.json", out)
        title = f"{label}: {model}, {args.request_rate:g} req/s"
        results = [RequestResult.from_dict(r) for r in out["requests"]]
        if not plot_run(args.result_dir / f"{label}.png", results, title):
            print("matplotlib is not installed: no PNG written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
