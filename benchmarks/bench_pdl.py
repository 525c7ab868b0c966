"""Programmatic dependent launch (`common/model/kernels/pdl.py`) on a decode step's FP8 chain.

    python benchmarks/bench_pdl.py [--m 1 8 32 128] [--reps 30] [--rounds 2] [--out pdl.json]

One CUDA graph holds every layer's FP8 linear chain as the decode step runs it (Qwen2.5-7B
shapes, 28 layers, each with its own weights: 6.5 GB, far past L2): RMSNorm -> FP8, qkv GEMM,
the o_proj input's quantization (the qkv output's first 3584 columns stand in for attention's
output), o GEMM, residual RMSNorm -> FP8, gate_up GEMM, SiLU-and-mul -> FP8, down GEMM; each op
reads what the one before wrote. Modes, captured and timed alternately in one process:
  off       PDSERVE_PDL=0: every kernel waits for the previous one to finish
  pdl       each kernel launched early, waiting in gdc_wait (what the engine runs)
Attention, rotary and the LM head are left out; the step's floor here is the chain's bytes
(FP8 weights) at the copy rate measured in the same run. Each output of the pdl modes is
checked against the off mode's (the same bits: PDL changes when kernels start, not what they
compute).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, QKV, INTER, LAYERS = 3584, 4608, 18944, 28
MODES = {"off": "0", "pdl": "1"}


def build(device):
    from common.model.quantization.activation import ActivationQuant

    fp8 = torch.float8_e4m3fn

    def weight(n, k):
        return (torch.randn(n, k, device=device) * 0.5).to(fp8), torch.rand(
            n, device=device
        ) * 1e-2 + 1e-3

    layers = [
        {"qkv": weight(QKV, HIDDEN), "o": weight(HIDDEN, HIDDEN), "gu": weight(2 * INTER, HIDDEN),
         "down": weight(HIDDEN, INTER), "ln1": torch.rand(HIDDEN, device=device, dtype=torch.bfloat16),
         "ln2": torch.rand(HIDDEN, device=device, dtype=torch.bfloat16)}
        for _ in range(LAYERS)
    ]  # fmt: skip
    return layers, ActivationQuant("token")


def chain(layers, quant, h0):
    from common.model.kernels import fp8_gemm_kernels as gemm
    from common.model.kernels import fp8_quant

    h, res = h0, None
    for w in layers:
        xq, res = fp8_quant.rms_norm_fp8(h, w["ln1"], 1e-6, res if res is not None else h, quant)
        qkv = gemm.w8a8_channel_mm(xq.data, xq.scale, *w["qkv"], torch.bfloat16)
        aq = fp8_quant.quantize_fp8(qkv[:, :HIDDEN], quant)
        o = gemm.w8a8_channel_mm(aq.data, aq.scale, *w["o"], torch.bfloat16)
        xq, res = fp8_quant.rms_norm_fp8(o, w["ln2"], 1e-6, res, quant)
        gu = gemm.w8a8_channel_mm(xq.data, xq.scale, *w["gu"], torch.bfloat16)
        hq = fp8_quant.silu_and_mul_fp8(gu, quant)
        h = gemm.w8a8_channel_mm(hq.data, hq.scale, *w["down"], torch.bfloat16)
    return h


def capture(fn):
    """A warm-up, then the capture, marked as the engine marks its captures (PDL launches)."""
    from common.model.graph_capture import recording_graphs

    with recording_graphs():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
    return graph, out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("pdl.json"))
    args = ap.parse_args()
    from benchmarks import roofline

    device = torch.device("cuda")
    torch.manual_seed(0)
    layers, quant = build(device)
    weight_bytes = sum(w[k][0].numel() for w in layers for k in ("qkv", "o", "gu", "down"))
    rate = roofline.measure_ceilings()["copy_bytes_per_s"]
    rows = []
    failed = False
    for m in args.m:
        h0 = torch.randn(m, HIDDEN, device=device, dtype=torch.bfloat16)
        best: dict[str, float] = {}
        outs: dict[str, torch.Tensor] = {}
        for _ in range(args.rounds):
            for mode, flag in MODES.items():
                os.environ["PDSERVE_PDL"] = flag
                graph, out = capture(functools.partial(chain, layers, quant, h0))
                ms = roofline.time_fn(graph.replay, args.reps, True) * 1e3
                outs[mode] = out.clone()
                best[mode] = min(best.get(mode, float("inf")), ms)
                del graph
        floor_ms = weight_bytes / rate * 1e3
        row = {"m": m, "floor_ms": floor_ms, **{f"{k}_ms": v for k, v in best.items()}}
        for mode in MODES:
            same = torch.equal(outs[mode], outs["off"])
            row[f"{mode}_same_bits"] = same
            failed |= not same
        rows.append(row)
        print(
            f"M={m:4d} floor {floor_ms:.3f} ms | "
            + " | ".join(f"{k} {v:.3f} ms (x{v / floor_ms:.2f})" for k, v in best.items())
            + f" | pdl speed-up x{best['off'] / best['pdl']:.3f}"
        )
    os.environ.pop("PDSERVE_PDL", None)
    result = {"gpu": torch.cuda.get_device_name(), "copy_rate_Bps": rate, "weight_bytes": weight_bytes,
              "torch": torch.__version__, "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1))
    if failed:
        print("FAIL: a PDL mode's output differs from the off mode's")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
