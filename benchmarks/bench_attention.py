"""Paged attention microbenchmark: bf16 against FP8 KV caches, decode and prefill, per layer call.

    python benchmarks/bench_attention.py [--out attn.json] [--batch 1 32 128] [--ctx 1024 8192]
        [--prefill 2048 8192] [--block-n 32 64 128] [--warps 4 8] [--stages 2 3]
        [--prefill-rows 64 128] [--reps 30]
    python benchmarks/bench_attention.py --smoke        # tiny shapes (a CPU: the interpreter)

Shapes are Qwen2.5-7B's (28 query heads, 4 KV heads, head_dim 128, pages of 16) unless
--heads/--kv-heads/--head-dim say otherwise. Variants of the cache and the products' dtype:
`bf16` (a bf16 cache), `fp8/bf16` (an e4m3 cache widened to bf16 in registers) and `fp8/fp16`
(widened to fp16: `paged_attention`'s default for a bf16 q), each at every combination of
--block-n (0, the default: the kernel's choice), --warps, --stages (0: the kernel's) and, for
prefill, --prefill-rows (the most rows of a tile: query tokens x the GQA group). --batch with
no values skips decode.

Decode: B sequences of ctx keys in shuffled pages; `layers` caches (one per layer, together
over 200 MB, so no call finds its keys in L2) share one block table. One CUDA graph replays one
decode call per layer (with the split count `decode_num_splits` gives the engine); us_per_call
= median replay / layers. floor_us = the KV bytes of the call at the copy rate measured in the
same run (bytes read + written per second by a large device copy); floor_frac = floor / time.
Prefill: one fresh causal prompt of N tokens per layer call, eager, CUDA events (on CUDA, the
`fresh` row: the same prompt through `fresh_prefill`, PyTorch's SDPA); tflops counts
4 * head_dim * heads * N (N + 1) / 2 multiply-adds x 2. Every variant's first decode call and
each prefill is checked against fp32 attention over the dequantized cache (`max_err`); beyond
--tol the run exits 1. Leaves out: the KV write, rotary and the rest of a layer.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PAGE = 16
L2_DEFEAT_BYTES = 200e6
K_SCALE, V_SCALE = 0.05, 0.02
VARIANTS = {"bf16": (torch.bfloat16, None), "fp8/bf16": (torch.float8_e4m3fn, False),
            "fp8/fp16": (torch.float8_e4m3fn, True)}  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="*", default=[1, 32, 128])
    p.add_argument("--ctx", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--prefill", type=int, nargs="*", default=[2048, 8192])
    p.add_argument("--block-n", type=int, nargs="+", default=[0], help="0: the kernel's choice")
    p.add_argument("--warps", type=int, nargs="+", default=[4])
    p.add_argument("--stages", type=int, nargs="+", default=[0], help="0: the kernel's")
    p.add_argument("--prefill-rows", type=int, nargs="+", default=[64], help="rows of a tile")
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--tol", type=float, default=3e-2)
    p.add_argument("--out", type=Path)
    p.add_argument("--smoke", action="store_true", help="tiny shapes")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.ctx, args.prefill, args.reps = [2], [40], [24], 1
        args.heads, args.kv_heads, args.head_dim, args.block_n = 4, 2, 32, [16]
    return args


def caches(layers: int, blocks: int, args, dtype: torch.dtype, device) -> list[tuple]:
    """`layers` (K, V) pools of `blocks` pages; FP8 ones hold e4m3 of values / scale."""
    out = []
    for _ in range(layers):
        shape = (blocks, PAGE, args.kv_heads, args.head_dim)
        k = torch.randn(shape, device=device, dtype=torch.bfloat16)
        v = torch.randn(shape, device=device, dtype=torch.bfloat16)
        if dtype == torch.float8_e4m3fn:
            k, v = (k.float() / K_SCALE).clamp(-448, 448), (v.float() / V_SCALE).clamp(-448, 448)
        out.append((k.to(dtype), v.to(dtype)))
    return out


def dequantized(cache: torch.Tensor, scale: float) -> torch.Tensor:
    return cache.float() * (scale if cache.dtype == torch.float8_e4m3fn else 1.0)


def reference_decode(q, kc, vc, table, ctx, scale_k, scale_v, sm_scale) -> torch.Tensor:
    """fp32 attention of each row over its first ctx keys of the dequantized pages."""
    rows = []
    group = q.shape[1] // kc.shape[2]
    for i in range(q.shape[0]):
        pos = torch.arange(ctx, device=q.device)
        slots = table[i].long()[pos // PAGE] * PAGE + pos % PAGE
        keys = dequantized(kc.flatten(0, 1)[slots], scale_k).repeat_interleave(group, 1)
        values = dequantized(vc.flatten(0, 1)[slots], scale_v).repeat_interleave(group, 1)
        probs = (torch.einsum("hd,khd->hk", q[i].float(), keys) * sm_scale).softmax(-1)
        rows.append(torch.einsum("hk,khd->hd", probs, values))
    return torch.stack(rows)


def decode_rows(args, device, copy_rate: float | None) -> list[dict]:
    from benchmarks.bench_mla_decode import time_us  # one CUDA graph, median of its replays
    from common.model.kernels.paged_attention import (
        DecodeScratch,
        decode_num_splits,
        paged_decode_attention,
    )

    cuda, rows = device.type == "cuda", []
    sm_scale = args.head_dim**-0.5
    for batch in args.batch:
        for ctx in args.ctx:
            pages = math.ceil(ctx / PAGE)
            gen = torch.Generator().manual_seed(0)
            table = torch.randperm(batch * pages + 1, generator=gen)[: batch * pages]
            table = table.view(batch, pages).to(device=device, dtype=torch.int32)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            q = torch.randn(batch, args.heads, args.head_dim, device=device, dtype=torch.bfloat16)
            out = torch.empty_like(q)
            splits = decode_num_splits(batch, args.kv_heads, ctx, device)
            scratch = None
            if splits > 1:
                scratch = DecodeScratch.allocate(batch, args.heads, splits, args.head_dim, device)
            for name, (dtype, fp16) in VARIANTS.items():
                kv_bytes = 2 * batch * ctx * args.kv_heads * args.head_dim * dtype.itemsize
                layers = max(1, min(28, math.ceil(L2_DEFEAT_BYTES / kv_bytes))) if cuda else 1
                pools = caches(layers, batch * pages + 1, args, dtype, device)
                fp8 = dtype == torch.float8_e4m3fn
                scales = dict(k_scale=K_SCALE, v_scale=V_SCALE) if fp8 else {}
                launches = [
                    (n, w, st) for n in args.block_n for w in args.warps for st in args.stages
                ]
                for block_n, warps, stages in launches:
                    calls = [
                        functools.partial(
                            paged_decode_attention, q, k, v, out, seq_lens, table, sm_scale,
                            scratch, block_n or None, fp16_products=fp16, num_warps=warps,
                            num_stages=stages or None, **scales,
                        )
                        for k, v in pools
                    ]  # fmt: skip
                    calls[0]()
                    check = slice(0, min(batch, 4))
                    ref = reference_decode(
                        q[check], *pools[0], table[check], ctx, K_SCALE, V_SCALE, sm_scale
                    )
                    err = (out[check].float() - ref).abs().max().item()
                    us = time_us(lambda calls=calls: [c() for c in calls], args.reps, cuda) / layers
                    floor = kv_bytes / copy_rate * 1e6 if copy_rate else None
                    row = dict(kind="decode", variant=name, batch=batch, ctx=ctx,
                               block_n=block_n, warps=warps, stages=stages, splits=splits,
                               layers=layers,
                               us_per_call=round(us, 2), kv_mb=round(kv_bytes / 1e6, 2),
                               floor_us=floor and round(floor, 2),
                               floor_frac=floor and round(floor / us, 3),
                               max_err=round(err, 5))  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del pools
                if cuda:
                    torch.cuda.empty_cache()
    return rows


def prefill_rows(args, device, bf16_rate: float | None) -> list[dict]:
    from benchmarks.roofline import time_fn
    from common.model.kernels.paged_attention import paged_prefill_attention

    cuda, rows = device.type == "cuda", []
    sm_scale = args.head_dim**-0.5
    for n in args.prefill:
        pages = math.ceil(n / PAGE)
        gen = torch.Generator().manual_seed(1)
        table = torch.randperm(pages, generator=gen).view(1, pages).to(device, torch.int32)
        seq_lens = torch.tensor([n], dtype=torch.int32, device=device)
        starts = torch.tensor([0, n], dtype=torch.int32, device=device)
        q = torch.randn(n, args.heads, args.head_dim, device=device, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        for name, (dtype, fp16) in VARIANTS.items():
            (kc, vc) = caches(1, pages, args, dtype, device)[0]
            fp8 = dtype == torch.float8_e4m3fn
            scales = dict(k_scale=K_SCALE, v_scale=V_SCALE) if fp8 else {}
            launches = [
                (bn, w, st, r)
                for bn in args.block_n
                for w in args.warps
                for st in args.stages
                for r in args.prefill_rows
            ]
            for block_n, warps, stages, rows_max in launches:
                call = functools.partial(
                    paged_prefill_attention, q, kc, vc, out, starts, seq_lens, table, n,
                    sm_scale, block_n or None, fp16_products=fp16, num_warps=warps,
                    num_stages=stages or None, max_rows=rows_max, **scales,
                )  # fmt: skip
                call()
                err = prefill_error(q, kc, vc, out, table, n, sm_scale)
                seconds = time_fn(call, args.reps, cuda)
                flops = 4 * args.head_dim * args.heads * n * (n + 1) / 2
                row = dict(kind="prefill", variant=name, tokens=n, block_n=block_n,
                           warps=warps, stages=stages, rows=rows_max,
                           ms=round(seconds * 1e3, 3), tflops=round(flops / seconds / 1e12, 1),
                           bf16_frac=bf16_rate and round(flops / seconds / bf16_rate, 3),
                           max_err=round(err, 5))  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
            if name == "bf16" and cuda:
                rows.append(fresh_row(q, kc, vc, out, table, n, sm_scale, args, bf16_rate))
    return rows


def fresh_row(q, kc, vc, out, table, n, sm_scale, args, bf16_rate) -> dict:
    """The same prompt through `fresh_prefill` (PyTorch's SDPA over the fresh k and v, gathered
    here from the cache), as the triton backend runs a long fresh prompt."""
    from benchmarks.roofline import time_fn
    from common.model.attention.base import AttentionMetadata
    from common.model.attention.fresh_prefill import fresh_prefill

    pos = torch.arange(n, device=q.device)
    slots = table[0].long()[pos // PAGE] * PAGE + pos % PAGE
    k, v = kc.flatten(0, 1)[slots], vc.flatten(0, 1)[slots]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=q.device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=q.device), block_tables=table,
        slot_mapping=slots, query_lens_cpu=[n], seq_lens_cpu=[n], max_query_len=n,
        max_seq_len=n,
    )  # fmt: skip
    call = functools.partial(fresh_prefill, q, k, v, meta, sm_scale)
    out.copy_(call())
    err = prefill_error(q, kc, vc, out, table, n, sm_scale)
    seconds = time_fn(call, args.reps, True)
    flops = 4 * args.head_dim * args.heads * n * (n + 1) / 2
    row = dict(kind="prefill", variant="fresh", tokens=n, block_n=0, warps=0, stages=0, rows=0,
               ms=round(seconds * 1e3, 3), tflops=round(flops / seconds / 1e12, 1),
               bf16_frac=bf16_rate and round(flops / seconds / bf16_rate, 3),
               max_err=round(err, 5))  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def prefill_error(q, kc, vc, out, table, n, sm_scale) -> float:
    """Max |out - fp32 reference| over the last 64 query rows (the longest; all rows would
    need an n x n score matrix per head)."""
    last = slice(max(0, n - 64), n)
    pos = torch.arange(n, device=q.device)
    slots = table[0].long()[pos // PAGE] * PAGE + pos % PAGE
    group = q.shape[1] // kc.shape[2]
    keys = dequantized(kc.flatten(0, 1)[slots], K_SCALE).repeat_interleave(group, 1)
    values = dequantized(vc.flatten(0, 1)[slots], V_SCALE).repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q[last].float(), keys) * sm_scale
    visible = pos[None, :] <= pos[last][:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    ref = torch.einsum("hqk,khd->qhd", probs, values)
    return (out[last].float() - ref).abs().max().item()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"
    device = torch.device("cuda" if cuda else "cpu")
    from benchmarks.roofline import measure_ceilings

    ceilings = measure_ceilings() if cuda else None
    copy_rate = ceilings and ceilings["copy_bytes_per_s"]
    print(json.dumps({"ceilings": ceilings}), flush=True)
    rows = decode_rows(args, device, copy_rate) + prefill_rows(
        args, device, ceilings and ceilings["bf16_flops_per_s"]
    )
    worst = max(r["max_err"] for r in rows)
    result = {"ceilings": ceilings, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "shape": dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                            page=PAGE), "rows": rows}  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(rows)
    if worst > args.tol:
        print(f"max_err {worst} beyond --tol {args.tol}", file=sys.stderr)
        return 1
    return 0


def print_table(rows: list[dict]) -> None:
    print(
        "\nkind     variant   shape          tile (keys warps stages)  time         of floor/rate  max_err"
    )
    for r in rows:
        tile = str(r["block_n"] or "auto")
        if r["kind"] == "decode":
            shape, time_s = f"b{r['batch']} ctx{r['ctx']}", f"{r['us_per_call']} us"
            frac, tile = r["floor_frac"], f"{tile} {r['warps']} {r['stages'] or 'auto'}"
        else:
            shape, time_s, frac = f"{r['tokens']} tokens", f"{r['ms']} ms", r["bf16_frac"]
            tile = f"{tile} {r['warps']} {r['stages'] or 'auto'} m{r['rows']}"
        frac_s = "-" if frac is None else f"{frac:.0%}"
        print(f"{r['kind']:8} {r['variant']:9} {shape:14} {tile:26} {time_s:12} {frac_s:>13}  "
              f"{r['max_err']:.2e}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
