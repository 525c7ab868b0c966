"""Engine benchmark: the decode node's real loop against the HBM floor, prefill against
max(weight-read floor, FLOP floor), offline throughput, graph memory. One GPU, dummy weights of a
real architecture (default Qwen2.5-7B in bf16; `--quantization fp8` quantizes them at load,
`--kv-cache-dtype fp8` stores KV in e4m3); ceilings (copy bandwidth, bf16 and FP8 matmul rates)
are measured in the same run (`benchmarks/roofline.py`).

    python benchmarks/bench_engine.py --out benchmarks/results/engine         # everything
    python benchmarks/bench_engine.py --parts throughput --peers hf_cb --peer-requests 64
    python benchmarks/bench_engine.py --smoke        # CPU, embedded model, tiny sizes: code paths
    python benchmarks/bench_engine.py --quantization fp8 --kv-cache-dtype fp8 --out .../fp8

Decode: `benchmarks/decode_loop.py` drives a real `DecodeNode` (scheduler, outputs, TokenBatch
messages included) at batch 1, 32, 128 with requests finishing and joining, all greedy and then
mixed (half greedy, half temperature + top-p + penalties + seeds), overlapped, plus the
synchronous loop for comparison. The floor of a step is (weights as stored + the KV of every
running request in the pool's dtype) / copy bandwidth; a prefill's FLOP floor runs FP8 matmuls
at the FP8 rate (each row names its `matmul_ceiling`). The JSON's "engine" records the
quantization, KV dtype, weight bytes, KV bytes per token and the pool's capacity. Prints a
table last; writes <out>.json (and <out>.png).

Mixture-of-experts models (`benchmarks/roofline.py`): a decode step's floor reads every
non-expert weight and only the experts its tokens touch. After each timed run, the batch's next
step runs once more, eagerly and outside the timing, with hooks on the routers: its distinct
experts per layer (`touched_experts`) give `hbm_floor_s`, the floor the ratio is to; the
uniform-routing expectation gives `hbm_floor_uniform_s`. `--decode-contexts` (`--contexts`)
sets the decode sequences' context (e.g. 1024 8192 for DeepSeek-V2-Lite's latent cache).

    python benchmarks/bench_engine.py --model benchmarks/configs/qwen3-30b-a3b --parts decode prefill
    python benchmarks/bench_engine.py --smoke --tiny qwen3-moe    # CPU, a tiny random Qwen3-MoE
    python benchmarks/bench_engine.py --smoke --tiny deepseek-v2  # skipped without the model class
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import itertools
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from benchmarks import hf_peers  # noqa: E402
from benchmarks.bench_messages import prefill_rows  # noqa: E402
from benchmarks.decode_loop import LoopDriver, build_node, greedy_params, mixed_params  # noqa: E402
from benchmarks.engine_floors import decode_floors, experts_info, touched_experts  # noqa: E402
from benchmarks.engine_report import plot, print_table  # noqa: E402
from benchmarks.moe_configs import TINY, unservable, write_tiny  # noqa: E402
from benchmarks.profiles import host_table, kernel_table, timeline  # noqa: E402
from benchmarks.roofline import (  # noqa: E402
    expert_layers,
    measure_ceilings,
    prefill_floors,
    time_fn,
    weight_bytes,
)
from benchmarks.stack import pick_ports  # noqa: E402
from common import LLM, SamplingParams  # noqa: E402
from common.engine.config import EngineConfig  # noqa: E402
from common.engine.scheduler import ScheduledBatch, ScheduledSeq  # noqa: E402
from common.engine.sequence import Sequence  # noqa: E402
from common.model.quantization.config import resolve_quantization  # noqa: E402

CONFIG = ROOT / "configs" / "qwen2.5-7b-instruct"


def engine_options(args: argparse.Namespace) -> dict:
    options = dict(
        model=args.model or None,
        load_format=args.load_format,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        attention_backend=args.attention_backend,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.prefill_graph_max_tokens is not None:
        options["prefill_graph_max_tokens"] = args.prefill_graph_max_tokens
    return options


def engine_info(worker, args) -> dict:
    rt, pool = worker.runtime, worker.kv_cache.pool
    scheme = resolve_quantization(worker.spec.quantization, args.quantization, args.load_format)
    return {
        "backend": rt.attention_backend,
        "quantization": args.quantization,
        "quantization_scheme": None if scheme is None else dataclasses.asdict(scheme),
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_dtype": str(pool.dtype).removeprefix("torch."),
        "weight_bytes": weight_bytes(worker.model),
        "experts": experts_info(worker.model),
        "kv_cache": worker.spec.kv_cache_geometry.describe(),
        "kv_bytes_per_token": worker.spec.kv_bytes_per_token(pool.element_size()),
        "num_kv_blocks": rt.num_kv_blocks,
        "kv_capacity_tokens": rt.num_kv_blocks * rt.block_size,
        "max_num_seqs": args.max_num_seqs,
        "decode_graph_bytes": rt.cuda_graph_bytes,
        "prefill_graph_bytes": rt.prefill_graph_bytes,
        "prefill_graph_buckets": list(rt.prefill_graph_buckets),
    }


def randomize(pool: torch.Tensor, chunk: int = 1 << 28) -> None:
    """Standard normal values in `pool`; an FP8 pool has no `normal_`: drawn in bf16 a chunk
    at a time (the pool fills most of the GPU) and rounded."""
    if pool.element_size() > 1:
        pool.normal_()
        return
    flat = pool.view(-1)
    for start in range(0, flat.numel(), chunk):
        part = flat[start : start + chunk]
        part.copy_(torch.randn(part.numel(), dtype=torch.bfloat16, device=pool.device))


def bench_decode_loop(args, ceil: dict | None, worker) -> list[dict]:
    """The decode node's loop on `worker` (its model, pool and graphs are reused)."""
    engine = EngineConfig.from_options(**engine_options(args))
    node, drain, prefill_address = build_node(engine, worker, pick_ports()[1])
    try:
        randomize(worker.kv_cache.pool)  # never time attention over zeros
        moe = bool(expert_layers(worker.model))
        mixes = {"greedy": greedy_params, "mixed": mixed_params}
        runs = [(mix, mixes[mix], True) for mix in args.mixes]
        if args.compare_sync and "greedy" in args.mixes:
            runs.append(("greedy", greedy_params, False))
        rows = []
        for context, (mix, params_fn, overlap) in itertools.product(args.decode_contexts, runs):
            driver = LoopDriver(node, prefill_address, context, args.min_new, args.max_new)
            driver.params_fn, node.core.overlap = params_fn, overlap
            batches = args.decode_batches
            for b in batches if overlap else [b for b in batches if b > 1]:
                profile = args.profile and overlap and b == max(batches)
                kernels = args.kernel_profile and overlap and b in (1, max(batches))
                r = driver.run(b, args.steps, args.warmup, profile)
                if kernels:  # a run under torch.profiler, apart from the timed one
                    print(f"decode loop at batch {b} ({mix}), {driver.kernel_profile(b, 20)}")
                replay = replay_time(worker, b) if overlap and mix == "greedy" else None
                scheduler = node.scheduler
                upcoming = [*scheduler.running, *scheduler.ready]  # the next step's rows
                touched = touched_experts(worker, upcoming) if moe else None
                driver.drain()
                row = {
                    "mix": mix,
                    "overlap": overlap,
                    "batch": b,
                    "context": context,
                    "step_s": r.step_s,
                    "graph_replay_s": replay,
                    "mean_running": r.mean_running,
                    "mean_context": r.mean_context,
                    "admitted": r.admitted,
                    **decode_floors(worker, ceil, r, touched),
                }
                floor = row["hbm_floor_s"]
                row["ratio_to_floor"] = None if floor is None else r.step_s / floor
                rows.append(row)
                print("decode loop:", row, flush=True)
                if r.profile:
                    print(f"host profile of the loop at batch {b} ({mix}):\n{r.profile}")
        return rows
    finally:
        drain.stop()
        node.admission.close()
        node.channel.close()


def replay_time(worker, batch: int) -> float | None:
    """GPU time of the decode graph alone at `batch` (its last staged inputs replayed)."""
    graphs = worker.runner.graphs
    if graphs is None or not graphs.on_cuda or not graphs.fits(batch):
        return None
    return time_fn(graphs.graphs[graphs.padded_size(batch)].replay, 20, True)


def bench_prefill(
    worker, ceil: dict | None, lengths: list[int], repeats: int, kernels: bool = False
) -> list[dict]:
    spec, cuda = worker.spec, worker.device.type == "cuda"
    rows = []
    for n in lengths:
        seq = Sequence(
            f"pre{n}",
            torch.randint(0, spec.vocab_size, (n,)).tolist(),
            SamplingParams(temperature=0),
        )
        seq.block_ids = worker.allocator.allocate(-(-(n + 1) // worker.config.cache.block_size))
        batch = ScheduledBatch([ScheduledSeq(seq, 0, n)])
        step = functools.partial(worker.runner.execute, batch)
        t = time_fn(step, repeats, cuda)
        if kernels:
            print(f"prefill of {n} tokens, {kernel_table(step, 5)}", flush=True)
            print(f"prefill of {n} tokens, {host_table(step, 5)}", flush=True)
            print(f"prefill of {n} tokens, {timeline(step)}", flush=True)
        worker.allocator.free(seq.block_ids)
        row = {"tokens": n, "time_s": t, "flop_floor_s": None, "weight_floor_s": None}
        if ceil is not None:
            row.update(prefill_floors(worker.model, spec, n, ceil))
            row["ratio_to_floor"] = t / max(row["flop_floor_s"], row["weight_floor_s"])
            row["fraction_of_matmul_rate"] = row["flop_floor_s"] / t
        rows.append(row)
        print("prefill:", row, flush=True)
    return rows


def workload(args, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    return [
        (
            [rng.randrange(100, vocab - 100) for _ in range(rng.randint(*args.prompt_range))],
            rng.randint(*args.output_range),
        )
        for _ in range(args.requests)
    ]


def bench_throughput(llm: LLM, reqs) -> dict:
    prompts = [p for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    llm.generate(prompts[:4], params[:4])  # warm-up (Triton autotune, allocator)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(n for _, n in reqs)
    return {"requests": len(reqs), "output_tokens": tokens, "time_s": elapsed,
            "tokens_per_s": tokens / elapsed}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=str(CONFIG), help="config dir (dummy weights); '' embedded")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="auto", choices=["auto", "fp8"],
                    help="fp8: W8A8, weights quantized at load (per channel; a config.json "
                    "stating FP8 blocks quantizes in blocks)")  # fmt: skip
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--parts", nargs="+", default=["decode", "prefill", "throughput"],
                    choices=["decode", "prefill", "throughput"])  # fmt: skip
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--decode-contexts", "--contexts", type=int, nargs="+",
                    help="context tokens of the decode batch's sequences (default 1024; "
                    "--smoke: 48)")  # fmt: skip
    ap.add_argument("--min-new", type=int, default=64, help="decode requests' max_tokens range")
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--steps", type=int, default=200, help="measured decode steps per run")
    ap.add_argument("--mixes", nargs="+", default=["greedy", "mixed"], choices=["greedy", "mixed"])
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--compare-sync", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--profile", action="store_true", help="cProfile the loop's host side")
    ap.add_argument("--kernel-profile", action="store_true",
                    help="device time per kernel (torch.profiler): decode at batch 1 and the "
                    "largest, prefill at every length, with each prefill's host table and "
                    "timeline (`profiles.timeline`)")  # fmt: skip
    ap.add_argument("--prefill-lengths", type=int, nargs="+", default=[128, 512, 2048, 8192])
    ap.add_argument("--prefill-graph-max-tokens", type=int,
                    help="the engine's flag (default: the engine's default)")  # fmt: skip
    ap.add_argument("--requests", type=int, default=256, help="offline workload size")
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--output-range", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--peers", nargs="*", default=[], choices=["hf_cb", "hf_generate"])
    ap.add_argument("--peer-requests", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, tiny sizes; the embedded model unless --model names another "
                    "config (a small one: dummy weights)")  # fmt: skip
    ap.add_argument("--tiny", choices=sorted(TINY),
                    help="a tiny random config of that family (written next to --out, dummy "
                    "weights) instead of --model")  # fmt: skip
    ap.add_argument("--out", default="benchmarks/results/engine")
    args = ap.parse_args(argv)
    if args.tiny:
        out = Path(args.out)
        args.model = str(write_tiny(args.tiny, out.parent / f"{out.name}_{args.tiny}"))
        args.load_format = "dummy"
    if args.smoke:
        if args.model == str(CONFIG):
            args.model, args.load_format = "", "auto"
        args.dtype, args.device = "float32", "cpu"
        args.decode_batches, args.min_new, args.max_new = [1, 4], 3, 6
        args.decode_contexts = args.decode_contexts or [48]
        args.steps, args.warmup, args.prefill_lengths, args.repeats = 6, 2, [16, 64], 2
        args.requests, args.prompt_range, args.output_range = 6, [8, 24], [3, 6]
        args.max_num_seqs, args.max_num_batched_tokens, args.peers = 8, 256, []
    args.decode_contexts = args.decode_contexts or [1024]
    return args


def main(argv: list[str] | None = None) -> dict:
    """Runs the parts; returns what it wrote to <out>.json (`{"skipped": why}` for a --tiny
    family this checkout cannot build)."""
    args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    reason = unservable(Path(args.model)) if args.tiny else None
    if reason is not None:
        print(f"--tiny {args.tiny}: skipped, this checkout cannot build it ({reason})")
        return {"skipped": reason}
    ceil = measure_ceilings()
    result: dict = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": Path(args.model).name if args.model else "embedded",
        "ceilings": ceil,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "args": vars(args),
    }
    llm = LLM(**engine_options(args))  # one loaded model for every part
    worker = llm.engine.worker
    result["engine"] = engine_info(worker, args)
    print("engine:", result["engine"], flush=True)
    if "decode" in args.parts:
        result["decode"] = bench_decode_loop(args, ceil, worker)
    if "prefill" in args.parts:
        result["prefill"] = bench_prefill(
            worker, ceil, args.prefill_lengths, args.repeats, args.kernel_profile
        )
    if "throughput" in args.parts:
        reqs = workload(args, llm.engine.runtime.vocab_size)
        result["throughput"] = {f"ours_{len(reqs)}": bench_throughput(llm, reqs)}
        if args.peers:
            subset = reqs[: args.peer_requests]
            result["throughput"][f"ours_{len(subset)}"] = bench_throughput(llm, subset)
    del llm, worker
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if "throughput" in args.parts:
        if args.peers:
            result["throughput"].update(hf_peers.run(args, Path(args.model), subset))
        print("throughput:", result["throughput"], flush=True)
    result["messages"] = prefill_rows(8192, 500)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print_table(result)
    return result


if __name__ == "__main__":
    main()
