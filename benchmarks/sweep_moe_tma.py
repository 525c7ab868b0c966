"""Expert GEMM tiles read through TMA descriptors (`GemmTiles.tma`) against the same tiles read
by per-thread loads, at Qwen3-30B-A3B shapes (128 experts, top-8, hidden 2048, expert
intermediate 768), bf16 and FP8 (128 x 128 blocks, per-row scales). Each config's whole
`fused_moe_triton` (plan, both GEMMs, slot sum; FP8: the activation quantizations) runs as one
CUDA graph over 4 rotated weight copies, as in `sweep_moe_fp8.py`; the median of 5 timings of
20 replays. What the prefill entries of `fused_moe.MOE_CONFIGS` were chosen from. One GPU:

    python benchmarks/sweep_moe_tma.py [tokens ...]

Prints one line per run; the rows go to sweep_moe_tma.json in the working directory.
"""

import dataclasses
import json
import sys

import torch

from common.model.kernels import fused_moe as fm
from common.model.quantization import fp8_ops
from common.model.quantization.fp8_experts import ExpertScales

E, K_TOP, H, INTER = 128, 8, 2048, 768
COPIES = 4
dev = "cuda"


def quantize(w, group):
    pairs = [
        fp8_ops.quantize_weight_blocks(one, group) if group else fp8_ops.quantize_per_token(one)
        for one in w.float()
    ]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def time_us(fn, reps=20):
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in range(COPIES):
            fn(c)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps / COPIES)
    return sorted(times)[2]


def variants(config: fm.MoEConfig) -> dict[str, fm.MoEConfig]:
    """The config as it is, with TMA, and each GEMM's pipeline depth 3 or 4 and group_m 4 / 16."""

    def tiles(t, tma, stages):
        return dataclasses.replace(t, tma=tma, num_stages=stages)

    out = {}
    for tma in (False, True):
        for s1, s2 in ((3, 3), (4, 4), (4, 3), (3, 4)):
            name = f"{'tma' if tma else 'ptr'} s{s1}/{s2}"
            up, down = tiles(config.gate_up, tma, s1), tiles(config.down, tma, s2)
            out[name] = dataclasses.replace(config, gate_up=up, down=down)
    best = out["tma s4/4"]
    out["tma s4/4 g4"] = dataclasses.replace(best, group_m=4)
    out["tma s4/4 g16"] = dataclasses.replace(best, group_m=16)
    return out


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [2048, 4096, 8192]
    torch.manual_seed(0)
    bf, fp = [], {"block": [], "row": []}
    for _ in range(COPIES):
        w13 = (torch.randn(E, 2 * INTER, H, device=dev) * H**-0.5).bfloat16()
        w2 = (torch.randn(E, H, INTER, device=dev) * INTER**-0.5).bfloat16()
        bf.append((w13, w2, None))
        for name, group in (("block", (128, 128)), ("row", None)):
            q13, s13 = quantize(w13, group)
            q2, s2 = quantize(w2, group)
            gn, gk = group or (1, 0)
            fp[name].append((q13, q2, ExpertScales(s13, s2, gn, gk)))
    rows = []
    for tokens in sizes:
        g = torch.Generator().manual_seed(tokens)
        ids = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(tokens)])
        ids = ids.int().to(dev)
        tw = (torch.rand(tokens, K_TOP, generator=g) + 0.1).to(dev)
        x = torch.randn(tokens, H, device=dev).bfloat16()
        flops = 2 * tokens * K_TOP * 3 * H * INTER
        for layout, weights in (("bf16", bf), ("fp8 block", fp["block"]), ("fp8 row", fp["row"])):
            if layout != "bf16" and tokens not in (2048, 8192):
                continue
            scales = weights[0][2]
            config = fm.pick_config(tokens, K_TOP, weights[0][0], scales=scales)
            ref = None
            for name, cfg in variants(config).items():

                def call(c, cfg=cfg, weights=weights, x=x, tw=tw, ids=ids):
                    w13, w2, s = weights[c]
                    return fm.fused_moe_triton(x, w13, w2, tw, ids, config=cfg, scales=s)

                out = call(0).float()
                ref = out if ref is None else ref
                us = time_us(call)
                row = dict(
                    tokens=tokens, layout=layout, variant=name, us=round(us, 1),
                    tflops=round(flops / us / 1e6, 1),
                    max_diff=(out - ref).abs().max().item(), config=dataclasses.asdict(cfg),
                )  # fmt: skip
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "config"}), flush=True)
    with open("sweep_moe_tma.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
