"""FP8 expert tile configs at Qwen3-30B-A3B shapes (128 experts, top-8, hidden 2048, expert
intermediate 768) against the bf16 experts' defaults: each config's `fused_moe_triton` (the
activation quantizations included) as one CUDA graph over 4 rotated weight copies, block and
per-row scales. What `fused_moe.FP8_PREFILL_CONFIGS` was chosen from. One GPU:

    python benchmarks/sweep_moe_fp8.py [gemv] [mid] [prefill] [tail]

"tail": the prefill sizes' default configs (bf16 and FP8) against the same with `tail_m`, so
that an expert's last block, when it holds few pairs, multiplies only its first tail_m rows.

Prints a line per run and the best per (tokens, layout); the rows go to sweep_moe_fp8.json
beside the script's working directory.
"""

import dataclasses
import itertools
import json
import sys

import torch

from common.model.kernels import fused_moe as fm
from common.model.kernels.fused_moe import GemmTiles, GemvConfig, GemvTiles
from common.model.quantization import fp8_ops
from common.model.quantization.fp8_experts import ExpertScales

E, K_TOP, H, INTER = 128, 8, 2048, 768
COPIES = 4
torch.manual_seed(0)
dev = "cuda"


def quantize(w, group):
    pairs = [
        fp8_ops.quantize_weight_blocks(one, group) if group else fp8_ops.quantize_per_token(one)
        for one in w.float()
    ]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


bf = []
fp = {"block": [], "row": []}
for _ in range(COPIES):
    w13 = (torch.randn(E, 2 * INTER, H, device=dev) * H**-0.5).bfloat16()
    w2 = (torch.randn(E, H, INTER, device=dev) * INTER**-0.5).bfloat16()
    bf.append((w13, w2))
    for name, group in (("block", (128, 128)), ("row", None)):
        q13, s13 = quantize(w13, group)
        q2, s2 = quantize(w2, group)
        gn, gk = group or (1, 0)
        fp[name].append((q13, q2, ExpertScales(s13, s2, gn, gk)))


def routing(t, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(t)]).int().to(dev)
    w = (torch.rand(t, K_TOP, generator=g) + 0.1).to(dev)
    return w, ids


def time_us(fn, reps=10):
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in range(COPIES):
            fn(c)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps / COPIES


rows = []


def run(t, layout, config, label):
    x = torch.randn(t, H, device=dev).bfloat16()
    w, ids = routing(t, t)
    try:
        if layout == "bf16":
            us = time_us(lambda c: fm.fused_moe_triton(x, *bf[c], w, ids, config=config))
        else:
            us = time_us(
                lambda c: fm.fused_moe_triton(
                    x,
                    fp[layout][c][0],
                    fp[layout][c][1],
                    w,
                    ids,
                    config=config,
                    scales=fp[layout][c][2],
                )
            )
    except Exception as e:  # noqa: BLE001
        print(t, layout, label, "ERR", str(e)[:200], flush=True)
        return
    rows.append(dict(tokens=t, layout=layout, config=label, us=us))
    print(f"{t:5d} {layout:5s} {us:9.1f} us  {label}", flush=True)


which = sys.argv[1:] or ["gemv", "mid", "prefill"]
if "gemv" in which:
    for t in (1, 4):
        for layout in ("bf16", "block", "row"):
            run(t, layout, None, "default")
        base = fm.pick_config(t, K_TOP, bf[0][0])
        for bn, bk, warps, stages in itertools.product((8, 16, 32), (256, 512), (4,), (2, 4)):
            gu = GemvTiles(bn, bk, warps, stages)
            cfg = GemvConfig(gu, base.down, fill_sms=True)
            cfg = fm.narrowed(cfg, t * K_TOP, t, INTER, H, 132)
            for layout in ("block", "row"):
                run(t, layout, cfg, f"gate_up={gu}")
        for bn, bk, warps, stages in itertools.product((8, 16, 32), (256, 512), (4,), (2, 4)):
            dn = GemvTiles(bn, bk, warps, stages)
            cfg = fm.narrowed(GemvConfig(base.gate_up, dn), t * K_TOP, t, INTER, H, 132)
            for layout in ("block", "row"):
                run(t, layout, cfg, f"down={dn}")
if "mid" in which or "prefill" in which:
    sizes = ([32, 128] if "mid" in which else []) + ([2048] if "prefill" in which else [])
    for t in sizes:
        for layout in ("bf16", "block", "row"):
            run(t, layout, None, "default")
        base = fm.pick_config(t, K_TOP, bf[0][0])
        grid = (
            itertools.product((16, 32), (64, 128), (128,), (4,), (3, 4))
            if t < 1024
            else itertools.product((64, 128), (64, 128), (64, 128), (4, 8), (3,))
        )
        for bm, bn, bk, warps, stages in grid:
            tiles = GemmTiles(bn, bk, warps, stages)
            cfg = dataclasses.replace(base, block_m=bm, gate_up=tiles, down=tiles, fill_sms=False)
            for layout in ("block", "row"):
                run(t, layout, cfg, f"bm={bm} {tiles}")
if "tail" in which:
    for t in (2048, 4096, 8192):
        for layout in ("bf16", "block", "row"):
            scales = None if layout == "bf16" else fp[layout][0][2]
            base = fm.pick_config(t, K_TOP, bf[0][0], scales=scales)
            run(t, layout, base, f"default {base}")
            for tail in (0, 16, 32, 64):
                if tail < base.block_m and tail != base.tail_m:
                    run(t, layout, dataclasses.replace(base, tail_m=tail), f"tail_m={tail}")
with open("sweep_moe_fp8.json", "w") as f:
    json.dump(rows, f)
best = {}
for r in rows:
    key = (r["tokens"], r["layout"])
    if key not in best or r["us"] < best[key]["us"]:
        best[key] = r
print("BEST")
for k, r in sorted(best.items()):
    print(k, f"{r['us']:.1f}", r["config"])
