"""MLA decode microbenchmark: `paged_mla_decode` per layer call against its bytes floor.

    python benchmarks/bench_mla_decode.py [--out mla.json] [--batch 1 32 128] [--ctx 1024 8192]
        [--heads 16 128] [--reps 50] [--sweep-splits]
    python benchmarks/bench_mla_decode.py --smoke [--out x.json]   # CPU, TRITON_INTERPRET, tiny

Per (heads, batch, ctx): B sequences of ctx keys in shuffled pages of one block table, shared by
`layers` bf16 caches (one per layer, as in serving: together over 3x the L2, at most 61, so a
call never finds its keys cached). `us_per_call` is one CUDA graph replaying one decode call
per layer, timed with CUDA events, median of --reps replays, divided by the layers (CPU: eager,
perf_counter). `floor_us` = B * ctx * (Dc + Dr) * itemsize / copy rate, the copy rate being
bytes read + written per second by a large device-to-device copy in the same run;
`floor_frac` = floor_us / us_per_call. The splits are `mla_decode_splits` given max_seq_len =
ctx; --sweep-splits also times every power-of-two split count (JSON `sweep`). Each config's
first layer is checked against `mla_reference` (`max_err`; beyond --tol the run exits 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DC, DR, PAGE, MAX_LAYERS = 512, 64, 16, 61  # 61: DeepSeek-V3's layer count
SCALE = 192**-0.5


def time_us(fn: Callable[[], None], reps: int, cuda: bool) -> float:
    """Median time of `fn`: replays of a CUDA graph of it on a GPU, plain calls on a CPU."""
    fn()  # compiles the kernels
    if not cuda:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs) * 1e3


def copy_rate(device: torch.device, nbytes: int, reps: int) -> float:
    """Bytes read + written per second by a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (time_us(lambda: dst.copy_(src), reps, device.type == "cuda") * 1e-6)


def run_config(heads: int, batch: int, ctx: int, args, device: torch.device, rate: float) -> dict:
    from common.model.attention.mla_reference import mla_reference
    from common.model.kernels.mla_attention import (
        mla_decode_scratch,
        paged_mla_decode,
    )
    from common.model.kernels.paged_attention import DecodeScratch

    cuda = device.type == "cuda"
    dtype = torch.bfloat16
    pages = -(-ctx // PAGE)
    kv_bytes = batch * ctx * (DC + DR) * dtype.itemsize
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if cuda else 0
    layers = max(1, min(MAX_LAYERS, -(-3 * l2 // kv_bytes)))
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (batch * pages + 1, PAGE, 1, DC + DR)
    caches = [torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(layers)]
    perm = torch.randperm(batch * pages, generator=gen, device=device)
    tables = perm.view(batch, pages).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q_nope = torch.randn(batch, heads, DC, generator=gen, device=device, dtype=dtype)
    q_pe = torch.randn(batch, heads, DR, generator=gen, device=device, dtype=dtype)
    out = torch.empty_like(q_nope)

    def timed(scratch: DecodeScratch) -> float:
        def step() -> None:
            for cache in caches:
                paged_mla_decode(q_nope, q_pe, cache, tables, seq_lens, SCALE, out=out,
                                 scratch=scratch)  # fmt: skip

        return time_us(step, args.reps, cuda) / layers

    scratch = mla_decode_scratch(batch, heads, DC, device, max_seq_len=ctx)
    paged_mla_decode(q_nope, q_pe, caches[0], tables, seq_lens, SCALE, out=out, scratch=scratch)
    ref = mla_reference(q_nope, q_pe, caches[0], seq_lens, tables, SCALE).float()
    max_err = (out.float() - ref).abs().max().item()  # before timing overwrites `out`
    us = timed(scratch)
    floor_us = kv_bytes / rate * 1e6
    result = {
        "heads": heads, "batch": batch, "ctx": ctx, "layers": layers,
        "splits": scratch.acc.shape[2], "us_per_call": round(us, 2),
        "floor_us": round(floor_us, 2), "floor_frac": round(floor_us / us, 3),
        "max_err": max_err,
    }  # fmt: skip
    if args.sweep_splits:
        result["sweep"] = {
            splits: round(timed(DecodeScratch.allocate(batch, heads, splits, DC, device)), 2)
            for splits in (1, 2, 4, 8, 16, 32, 64)
        }
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tol", type=float, default=2e-2, help="max |out - ref| (bf16)")
    ap.add_argument("--sweep-splits", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET, tiny shapes")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.smoke and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        ap.error("no GPU: run with --smoke")
    if args.smoke:
        args.batch, args.ctx, args.heads, args.reps = [1, 2], [40], [16], 1
    rate = copy_rate(device, (1 << 20) if args.smoke else (1 << 30), 3 if args.smoke else 20)
    results = [
        run_config(heads, batch, ctx, args, device, rate)
        for heads in args.heads
        for batch in args.batch
        for ctx in args.ctx
    ]
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": "bfloat16",
        "copy_GBps": round(rate / 1e9, 1),
        "timing": "per layer call: median CUDA graph replay over the layers' caches / layers"
        if device.type == "cuda"
        else "per layer call: median eager call (CPU interpreter)",
        "results": results,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    bad = [r for r in results if not r["max_err"] <= args.tol]
    for r in bad:
        print(f"FAIL heads={r['heads']} batch={r['batch']} ctx={r['ctx']}: max_err "
              f"{r['max_err']:.3g} > {args.tol}", file=sys.stderr)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
