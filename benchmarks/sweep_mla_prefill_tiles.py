"""Key tiles of the absorbed MLA prefill kernel (`mla_attention.paged_mla_prefill`) on a bf16
and an FP8 latent cache: one layer's call, 16 heads (DeepSeek-V2-Lite, Moonlight), Dc 512,
Dr 64, 16-token pages in shuffled order, bf16 queries, per (new tokens, cached tokens).

    python benchmarks/sweep_mla_prefill_tiles.py [--out mla_prefill_tiles.json]

Each time is the median over REPS replays of a CUDA graph of one call, in us (launch
overhead out; `bench_mla_decode.time_us`); `max_diff_vs_32` is the largest difference from
the 32-key tile's output (the bf16 output's rounding). A tile that overflows shared memory is
reported as its error. GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_mla_decode import time_us  # noqa: E402
from common.model.kernels import mla_attention  # noqa: E402

HEADS, DC, DR, PAGE = 16, 512, 64, 16
SHAPES = ((512, 0), (2048, 0), (8192, 0), (2048, 4096))  # (new tokens, cached tokens)
TILES = (32, 64, 128)
REPS = 20


def sweep_shape(new: int, cached: int, dtype: torch.dtype) -> dict[str, object]:
    """Every tile of TILES on `new` tokens after `cached` ones in a `dtype` cache."""
    total = new + cached
    q_nope = torch.randn(new, HEADS, DC, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(new, HEADS, DR, device="cuda", dtype=torch.bfloat16)
    starts = torch.tensor([0, new], device="cuda", dtype=torch.int32)
    lens = torch.tensor([total], device="cuda", dtype=torch.int32)
    blocks = total // PAGE + 1
    cache = (torch.randn(blocks, PAGE, 1, DC + DR, device="cuda") * 0.5).to(dtype)
    table = torch.randperm(blocks, device="cuda").int().view(1, -1)

    def call(tile: int) -> torch.Tensor:
        return mla_attention.paged_mla_prefill(
            q_nope, q_pe, cache, starts, lens, table, new, 0.07, 1.0, block_n=tile
        )

    results: dict[str, object] = {}
    first = None
    for tile in TILES:
        key = f"new {new} cached {cached} {str(dtype).removeprefix('torch.')} tile {tile}"
        try:
            out = call(tile).float()
            first = out if first is None else first
            us = time_us(lambda tile=tile: call(tile), REPS, cuda=True)
            results[key] = {"us": round(us, 1), "max_diff_vs_32": (out - first).abs().max().item()}
        except Exception as e:  # shared memory overflow at compile time
            results[key] = f"{type(e).__name__}: {str(e)[:100]}"
        print(key, results[key], flush=True)
    return results


def sweep() -> dict[str, object]:
    results: dict[str, object] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    for new, cached in SHAPES:
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            results.update(sweep_shape(new, cached, dtype))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results = sweep()
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
