"""Warm start (issue 25): do the first decode steps of a fresh process on a fresh machine cost
what later ones do? One GPU, dummy weights of a real architecture (default Qwen2.5-7B, bf16).

Each case runs in its own fresh subprocess whose Triton, TorchInductor and CUDA caches are new
empty directories (set in its environment, so before it imports torch or triton): a container's
first start. There it builds the decode node (`benchmarks/decode_loop.py`: `build_node`,
`LoopDriver`) with the start-up warm-up (`common.engine.warmup`) or without it (`--no-warmup`),
and times every loop step from the first under a mixed load: half the requests greedy, half
sampled (temperature, top-p, penalties, a seed), each drawing max_tokens in [min, max] so
requests finish and join while it runs. It reports the mean and median step time of the first
`--steps` steps and of the next `--steps`, the time to ready, and the kernels that entered the
Triton cache after the node was ready (what still compiled under requests).

    python benchmarks/warm_start.py --out benchmarks/results/warm_start
    python benchmarks/warm_start.py --batch 8 --model benchmarks/configs/llama-3.1-8b-instruct
    python benchmarks/warm_start.py --smoke     # CPU, the embedded model: the code path only

Prints a table; writes <out>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

CONFIG = ROOT / "configs" / "qwen2.5-7b-instruct"
CASES = {"no warm-up": False, "warm-up": True}
# Caches a fresh machine has empty; each case gets new directories for them.
CACHE_VARIABLES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=str(CONFIG), help="config dir (dummy weights); '' embedded")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, default=1, help="running requests (issue 25: 1)")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens of each request")
    ap.add_argument("--min-new", type=int, default=16, help="requests' max_tokens range")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200, help="steps per window (two windows)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--smoke", action="store_true", help="CPU, embedded model, tiny sizes")
    ap.add_argument("--out", default="benchmarks/results/warm_start")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # the case's result file (subprocess)
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help=argparse.SUPPRESS)  # fmt: skip
    args = ap.parse_args(argv)
    if args.smoke:
        if args.model == str(CONFIG):
            args.model, args.load_format = "", "auto"
        args.dtype, args.device, args.context = "float32", "cpu", 48
        args.min_new, args.max_new, args.steps, args.max_num_seqs = 3, 6, 10, 8
    if not 1 <= args.batch <= args.max_num_seqs:
        raise ValueError(f"--batch {args.batch} must be in [1, --max-num-seqs {args.max_num_seqs}]")
    if args.steps < 1 or not 1 <= args.min_new <= args.max_new:
        raise ValueError(
            f"need --steps >= 1 and 1 <= --min-new <= --max-new, got {args.steps}, "
            f"{args.min_new}, {args.max_new}"
        )
    return args


def cache_entries(directory: Path) -> set[str]:
    """What a Triton cache holds: one `<hash>/<kernel>.json` per compiled kernel, `.so` files
    for its compiled launchers and utilities."""
    return {
        f"{p.parent.name[:8]}/{p.name}"
        for p in directory.glob("*/*")
        if p.suffix in (".json", ".so") and not p.name.startswith("__grp__")
    }


def window(times: list[float]) -> dict:
    return {
        "steps": len(times),
        "mean_ms": 1e3 * statistics.fmean(times),
        "median_ms": 1e3 * statistics.median(times),
        "max_ms": 1e3 * max(times),
    }


def child(args: argparse.Namespace) -> None:
    """One case in this fresh process: build the node, time 2 x --steps loop steps."""
    started = time.perf_counter()
    missing = [v for v in CACHE_VARIABLES if not os.environ.get(v)]
    assert not missing and "torch" not in sys.modules, missing  # caches chosen before torch
    import logging

    import torch

    from benchmarks.bench_engine import randomize
    from benchmarks.decode_loop import LoopDriver, build_node, mixed_params
    from benchmarks.stack import pick_ports
    from common import LLM

    messages: list[str] = []  # the warm-up's log line (steps and seconds)

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    warm_log = logging.getLogger("common.engine.warmup")
    warm_log.setLevel(logging.INFO)
    warm_log.addHandler(Collect())
    llm = LLM(
        args.model or None, load_format=args.load_format, dtype=args.dtype, device=args.device,
        max_num_seqs=args.max_num_seqs, enable_prefix_caching=False, warmup=args.warmup,
    )  # fmt: skip
    worker = llm.engine.worker
    node, drain, prefill = build_node(llm.engine.config, worker, pick_ports()[1])
    triton_cache = Path(os.environ["TRITON_CACHE_DIR"])
    cuda = worker.device.type == "cuda"
    try:
        randomize(worker.kv_cache.pool)  # attention over random KV, not zeros
        if cuda:
            torch.cuda.synchronize()
        ready_s = time.perf_counter() - started
        at_ready = cache_entries(triton_cache)
        driver = LoopDriver(node, prefill, args.context, args.min_new, args.max_new)
        driver.params_fn = mixed_params
        driver.top_up(args.batch)
        times, compiled = [], []
        for _ in range(2):
            for _ in range(args.steps):
                start = time.perf_counter()
                driver.step(args.batch)
                times.append(time.perf_counter() - start)
            compiled.append(sorted(cache_entries(triton_cache) - at_ready))
        if cuda:
            torch.cuda.synchronize()
        result = {
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "warmup": args.warmup,
            "warmup_log": messages,
            "ready_s": ready_s,
            "first": window(times[: args.steps]),
            "next": window(times[args.steps :]),
            "admitted": driver.admitted,
            "cache_at_ready": len(at_ready),
            "compiled_in_first": compiled[0],
            "compiled_in_next": sorted(set(compiled[1]) - set(compiled[0])),
        }
    finally:
        drain.stop()
        node.admission.close()
        node.channel.close()
    Path(args.child).write_text(json.dumps(result))


def run_case(argv: list[str], warmup: bool) -> dict:
    """The case in a fresh subprocess with fresh, empty caches."""
    with tempfile.TemporaryDirectory(prefix="warm_start_") as tmp:
        env = dict(os.environ)
        for variable in CACHE_VARIABLES:
            env[variable] = str(Path(tmp) / variable.lower())
            Path(env[variable]).mkdir()
        out = Path(tmp) / "result.json"
        flag = "--warmup" if warmup else "--no-warmup"
        command = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", str(out), flag]
        subprocess.run(command, env=env, check=True, cwd=ROOT.parent)
        return json.loads(out.read_text())


def print_table(result: dict) -> None:
    n = result["args"]["steps"]
    print(
        f"\nwarm start: {result['model']}, batch {result['args']['batch']}, "
        f"half greedy / half sampled, fresh caches per case ({result['device']})"
    )
    head = f"{'case':<12}{'ready s':>9}{f'first {n} ms':>18}{f'next {n} ms':>18}"
    print(head + f"{'first/next':>12}{'  compiled after ready'}")
    print(f"{'':<12}{'':>9}{'mean / median':>18}{'mean / median':>18}")
    for name, r in result["cases"].items():
        first, later = r["first"], r["next"]
        compiled = len(r["compiled_in_first"]) + len(r["compiled_in_next"])
        print(
            f"{name:<12}{r['ready_s']:>9.1f}"
            f"{first['mean_ms']:>9.2f} / {first['median_ms']:<6.2f}"
            f"{later['mean_ms']:>9.2f} / {later['median_ms']:<6.2f}"
            f"{first['mean_ms'] / later['mean_ms']:>12.2f}  {compiled}"
        )
    for name, r in result["cases"].items():
        for line in r["warmup_log"]:
            print(f"{name}: {line}")
        if r["compiled_in_first"] or r["compiled_in_next"]:
            print(
                f"{name}: compiled under requests: {r['compiled_in_first'] + r['compiled_in_next']}"
            )


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        child(args)
        return {}
    # The parent imports no torch: a CUDA context here would hold memory the cases need.
    cases = {name: run_case(argv, warmup) for name, warmup in CASES.items()}
    result = {
        "model": Path(args.model).name if args.model else "embedded",
        "device": next(iter(cases.values()))["device"],
        "date": time.strftime("%Y-%m-%d"),
        "args": vars(args),
        "cases": cases,
    }
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print_table(result)
    return result


if __name__ == "__main__":
    main()
