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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.moe_sweep_tools import expert_copies, graph_time_us  # noqa: E402
from common.model.kernels import fused_moe as fm  # noqa: E402
from common.model.kernels.fused_moe import GemmTiles, GemvConfig, GemvTiles  # noqa: E402

E, K_TOP, H, INTER = 128, 8, 2048, 768
COPIES = 4
torch.manual_seed(0)
dev = "cuda"


bf, fp = expert_copies(COPIES, E, H, INTER, dev)


def routing(t, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(t)]).int().to(dev)
    w = (torch.rand(t, K_TOP, generator=g) + 0.1).to(dev)
    return w, ids


def time_us(fn, reps=10):
    return graph_time_us(fn, COPIES, reps)


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
