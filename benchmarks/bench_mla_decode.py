"""MLA decode microbenchmark: `paged_mla_decode` per layer call against its bytes floor.

    python benchmarks/bench_mla_decode.py [--out mla.json] [--batch 1 32 128] [--ctx 1024 8192]
        [--heads 16 128] [--reps 50] [--sweep-splits] [--sweep-configs]
    python benchmarks/bench_mla_decode.py --smoke [--sweep-configs] [--out x.json]   # CPU, tiny

Per (heads, batch, ctx): B sequences of ctx keys in shuffled pages of one block table, shared by
`layers` bf16 caches (one per layer, as in serving: together over 3x the L2, at most 61, so a
call never finds its keys cached). `us_per_call` is one CUDA graph replaying one decode call
per layer, timed with CUDA events, median of --reps replays, divided by the layers (CPU: eager,
perf_counter). `floor_us` = B * ctx * (Dc + Dr) * itemsize / copy rate, the copy rate being
bytes read + written per second by a large device-to-device copy in the same run;
`floor_frac` = floor_us / us_per_call. The row runs `mla_decode_config`'s tiles with
`mla_decode_splits` given max_seq_len = ctx; --sweep-splits also times every power-of-two split
count (JSON `sweep`). --sweep-configs times each of `sweep_configs(heads)` at split counts
around the rule's for it (x1/4 .. x4; JSON `configs`, a failed compile recorded as `error`) and
prints the best per row after the JSON. Every timed call's first layer is checked against
`mla_reference` before timing (`max_err`; beyond --tol the run exits 1; a sweep entry beyond it
is recorded and not timed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the kernel modules are imported after TRITON_INTERPRET is decided
    from common.model.kernels.mla_decode import MLADecodeConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DC, DR, PAGE, MAX_LAYERS = 512, 64, 16, 61  # 61: DeepSeek-V3's layer count
SCALE = 192**-0.5
MAX_SPLITS = 64  # paged_attention.MAX_DECODE_SPLITS

# Sweep candidates by heads per program, as (block_n, num_warps, num_stages, out_split); a row
# with H heads tries BLOCK_H from top / 4 to top = max(16, next_pow2(H)). Each compiles for
# sm_90a within shared memory (Triton 3.9, offline): 64 rows need 8 warps for the 64 x 512
# accumulator (4 spill ~2 KB) or out_split 2; 128 rows only with out_split 2.
SWEEP_TILES: dict[int, tuple[tuple[int, int, int, int], ...]] = {
    16: ((32, 4, 2, 1), (32, 4, 3, 1), (64, 4, 3, 1), (32, 8, 2, 1), (16, 4, 3, 1), (32, 4, 2, 2)),
    32: ((32, 8, 2, 1), (32, 8, 3, 1), (64, 8, 2, 1)),
    64: (
        (32, 8, 2, 1), (32, 8, 3, 1), (16, 8, 2, 1), (16, 8, 3, 1), (64, 8, 2, 1), (32, 4, 2, 2),
        (16, 4, 3, 2),
    ),
    128: ((16, 8, 2, 2), (16, 8, 3, 2), (32, 8, 2, 2)),
}  # fmt: skip
SMOKE_TILES = {16: ((16, 4, 2, 1), (16, 4, 2, 2))}


def sweep_configs(heads: int, tiles: dict = SWEEP_TILES) -> list[MLADecodeConfig]:
    from common.model.kernels.mla_decode import MLADecodeConfig

    top = max(16, 1 << (heads - 1).bit_length())
    return [
        MLADecodeConfig(block_h, *t)
        for block_h, ts in tiles.items()
        if top // 4 <= block_h <= top
        for t in ts
    ]


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


@dataclasses.dataclass
class Case:
    """One (heads, batch, ctx): the layers' caches, the shared table, q and the reference."""

    heads: int
    batch: int
    ctx: int
    caches: list[torch.Tensor]
    tables: torch.Tensor
    seq_lens: torch.Tensor
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    out: torch.Tensor
    ref: torch.Tensor  # layer 0's output, float32
    kv_bytes: int

    def run(
        self, splits: int, config: MLADecodeConfig, reps: int, tol: float
    ) -> tuple[float, float | None]:
        """(max |layer 0 - ref|, us per layer call), timed only if the error is within tol."""
        from common.model.kernels.mla_decode import paged_mla_decode
        from common.model.kernels.paged_attention import DecodeScratch

        device = self.q_nope.device
        scratch = DecodeScratch.allocate(self.batch, self.heads, splits, DC, device)

        def call(cache: torch.Tensor) -> None:
            paged_mla_decode(self.q_nope, self.q_pe, cache, self.tables, self.seq_lens, SCALE,
                             out=self.out, scratch=scratch, config=config)  # fmt: skip

        self.out.fill_(float("nan"))  # a call that writes nothing cannot pass on a stale output
        call(self.caches[0])
        max_err = (self.out.float() - self.ref).abs().max().item()  # before timing overwrites it
        if not max_err <= tol:
            return max_err, None

        def step() -> None:
            for cache in self.caches:
                call(cache)

        return max_err, time_us(step, reps, device.type == "cuda") / len(self.caches)


def make_case(heads: int, batch: int, ctx: int, device: torch.device) -> Case:
    from common.model.attention.mla_reference import mla_reference

    dtype = torch.bfloat16
    pages = -(-ctx // PAGE)
    kv_bytes = batch * ctx * (DC + DR) * dtype.itemsize
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
    layers = max(1, min(MAX_LAYERS, -(-3 * l2 // kv_bytes)))
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (batch * pages + 1, PAGE, 1, DC + DR)
    caches = [torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(layers)]
    perm = torch.randperm(batch * pages, generator=gen, device=device)
    tables = perm.view(batch, pages).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q_nope = torch.randn(batch, heads, DC, generator=gen, device=device, dtype=dtype)
    q_pe = torch.randn(batch, heads, DR, generator=gen, device=device, dtype=dtype)
    ref = mla_reference(q_nope, q_pe, caches[0], seq_lens, tables, SCALE).float()
    return Case(heads, batch, ctx, caches, tables, seq_lens, q_nope, q_pe,
                torch.empty_like(q_nope), ref, kv_bytes)  # fmt: skip


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def config_name(config: MLADecodeConfig) -> str:
    """BLOCK_H/BLOCK_N/warps/stages/out_split, e.g. 64/32/w8/s2/o1."""
    c = config
    return f"{c.block_h}/{c.block_n}/w{c.num_warps}/s{c.num_stages}/o{c.out_split}"


def sweep_row(case: Case, args, device: torch.device) -> list[dict]:
    """Each candidate config at split counts around the rule's for it; a config that does not
    compile (shared memory) is recorded once and skipped."""
    from common.model.kernels.mla_decode import mla_decode_splits

    tiles = SMOKE_TILES if args.smoke else SWEEP_TILES
    entries = []
    for config in sweep_configs(case.heads, tiles):
        rule = mla_decode_splits(case.batch, case.heads, device, case.ctx, config=config)
        quarters = (4, 8) if args.smoke else (1, 2, 4, 8, 16)  # the rule's x1/4 .. x4
        splits = sorted({min(MAX_SPLITS, max(1, rule * q // 4)) for q in quarters})
        for s in splits:
            entry = {"config": config_name(config), "splits": s, "rule": s == rule}
            try:
                max_err, us = case.run(s, config, args.reps, args.tol)
            except Exception as exc:  # noqa: BLE001 - out of shared memory: next config
                entries.append({**entry, "error": f"{type(exc).__name__}: {exc}"[:300]})
                break
            entries.append({**entry, "us": _round(us, 2), "max_err": max_err})
    return entries


def run_row(heads: int, batch: int, ctx: int, args, device: torch.device, rate: float) -> dict:
    from common.model.kernels.mla_decode import mla_decode_config, mla_decode_splits

    case = make_case(heads, batch, ctx, device)
    config = mla_decode_config(heads)
    splits = mla_decode_splits(batch, heads, device, ctx, config=config)
    max_err, us = case.run(splits, config, args.reps, args.tol)
    floor_us = case.kv_bytes / rate * 1e6
    result = {
        "heads": heads, "batch": batch, "ctx": ctx, "layers": len(case.caches),
        "config": config_name(config), "splits": splits, "us_per_call": _round(us, 2),
        "floor_us": round(floor_us, 2), "floor_frac": _round(us and floor_us / us, 3),
        "max_err": max_err,
    }  # fmt: skip
    if args.sweep_splits:
        result["sweep"] = {}
        for s in (1, 2, 4, 8, 16, 32, 64):
            us = case.run(s, config, args.reps, args.tol)[1]
            result["sweep"][s] = _round(us, 2)
    if args.sweep_configs:
        result["configs"] = sweep_row(case, args, device)
    return result


def print_best(results: list[dict]) -> None:
    """Per row: the table's config at the rule's splits against the fastest checked entry."""
    print(f"{'heads':>5} {'batch':>5} {'ctx':>6} {'floor':>7} | {'default':>26} | best")
    for r in results:
        best = min((e for e in r["configs"] if e.get("us")), key=lambda e: e["us"], default=None)
        default = f"{r['config']} x{r['splits']} {r['us_per_call'] or float('nan'):.1f}"
        line = (
            f"{r['heads']:>5} {r['batch']:>5} {r['ctx']:>6} {r['floor_us']:>7.1f} | {default:>26}"
        )
        if best and r["us_per_call"]:
            line += f" | {best['config']} x{best['splits']} {best['us']:.1f}"
            line += f" ({r['us_per_call'] / best['us']:.2f}x)"
        print(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tol", type=float, default=2e-2, help="max |out - ref| (bf16)")
    ap.add_argument("--sweep-splits", action="store_true")
    ap.add_argument("--sweep-configs", action="store_true")
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
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": "bfloat16",
        "copy_GBps": round(rate / 1e9, 1),
        "timing": "per layer call: median CUDA graph replay over the layers' caches / layers"
        if device.type == "cuda"
        else "per layer call: median eager call (CPU interpreter)",
        "results": [],
    }
    started = time.perf_counter()
    for heads in args.heads:
        for batch in args.batch:
            for ctx in args.ctx:
                report["results"].append(run_row(heads, batch, ctx, args, device, rate))
                if args.out:  # after each row: a cut run keeps what it measured
                    args.out.write_text(json.dumps(report, indent=1) + "\n")
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    results = report["results"]
    if args.sweep_configs:
        print_best(results)
    bad = [r for r in results if not r["max_err"] <= args.tol]
    bad += [
        {**r, "max_err": e["max_err"], "config": e["config"]}
        for r in results
        for e in r.get("configs", [])
        if "max_err" in e and not e["max_err"] <= args.tol
    ]
    for r in bad:
        print(f"FAIL heads={r['heads']} batch={r['batch']} ctx={r['ctx']} {r['config']}: "
              f"max_err {r['max_err']:.3g} > {args.tol}", file=sys.stderr)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
