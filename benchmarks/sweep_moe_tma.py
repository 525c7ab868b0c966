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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.moe_sweep_tools import expert_copies, graph_time_us  # noqa: E402
from common.model.kernels import fused_moe as fm  # noqa: E402

E, K_TOP, H, INTER = 128, 8, 2048, 768
COPIES = 4
dev = "cuda"


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
    bf, fp = expert_copies(COPIES, E, H, INTER, dev)
    bf = [(w13, w2, None) for w13, w2 in bf]
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
                us = graph_time_us(call, COPIES, reps=20, trials=5)
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
