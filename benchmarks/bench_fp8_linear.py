"""FP8 linear microbenchmark: every GEMM candidate on the linear layers of Qwen2.5-7B and
Qwen3-8B, against bf16 F.linear, at decode and prefill M.

    python benchmarks/bench_fp8_linear.py [--out fp8_linear.json] [--m 1 8 32 ...] [--reps 30]
        [--models qwen2.5-7b qwen3-8b] [--sweep]
    python benchmarks/bench_fp8_linear.py --smoke [--out x.json]   # CPU, TRITON_INTERPRET, tiny

GEMM time alone: inputs are quantized once, outside the timed region. Each timing runs `calls`
back-to-back calls of one candidate whose weights rotate over enough clones to exceed 3x the L2
(consecutive layers never find their weights cached): "graph" is the replay of one CUDA graph
holding those calls, timed with CUDA events, per call, median of --reps replays after a warm-up
(launch gaps excluded); "eager" is the same loop launched from Python (launch cost included).
Each is the fastest of --rounds passes over the candidates, in alternating order.
The table sums one call of each of the four linears (qkv, o, gate_up, down) times the layer
count: the time of all layers' linears per step, and its speedup over bf16.

Candidates (each skippable: a failure is reported and the others go on):
  bf16          F.linear on bf16 weights
  tensor_mm     _scaled_mm, per-tensor scales (static activation scale)
  rowwise_mm    _scaled_mm, per-token x per-channel scales
  triton_chan   Triton per-token x per-channel kernel (fp8_gemm_kernels.w8a8_channel_mm)
  unit_mm_epi   per-tensor _scaled_mm with unit scales + Triton scale/bias epilogue
  triton_block  Triton block-scaled kernel, 1x128 activations x 128x128 weights
  block_mm      _scaled_mm with the same block scales, if this torch and GPU take them
  dispatch      fp8_linear with per-token x per-channel scales: what the model runs at this M
  block_disp    block_fp8_linear_cuda given the block scales: the block-scaled choice at M
  quant_disp    from the bf16 input: fp8_quant.quantize_fp8 (per token, its default path at
                M) then dispatch, what o_proj runs at this M
  q_row_disp    the same with one quantization program per row (the path before issue 20's
                split), for the before/after
Quantization alone, in the JSON detail (a per-step table is printed; their speedups are
meaningless): quant[PATH] (quantize_fp8) and silu[PATH] (silu_and_mul_fp8 of a [M, 2K]
input), PATH in fp8_quant.TOKEN_PATHS; each output is checked against fp8_ops' codes.
Every output is checked against the dequantizing reference of its own quantized operands
(bf16: the float32 product); max |out - ref| / max |ref| beyond --tol fails the run (exit 1)
after the table is printed. --sweep adds Triton tile-config variants to the JSON detail.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclasses.dataclass(frozen=True)
class Linear:
    name: str
    n: int
    k: int
    bias: bool


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    name: str
    layers: int
    linears: tuple[Linear, ...]


def _shapes(name, layers, hidden, q, kv, inter, qkv_bias) -> ModelShapes:
    return ModelShapes(
        name,
        layers,
        (
            Linear("qkv", q + 2 * kv, hidden, qkv_bias),
            Linear("o", hidden, q, False),
            Linear("gate_up", 2 * inter, hidden, False),
            Linear("down", hidden, inter, False),
        ),
    )


MODELS = {
    "qwen2.5-7b": _shapes("qwen2.5-7b", 28, 3584, 3584, 512, 18944, True),
    "qwen3-8b": _shapes("qwen3-8b", 36, 4096, 4096, 1024, 12288, False),
}
# N and K off the tiles (K = 200: a partial 128 block), bias on one layer.
SMOKE = _shapes("tiny", 2, 256, 128, 16, 96, True)
SMOKE = dataclasses.replace(SMOKE, linears=SMOKE.linears + (Linear("odd", 72, 200, False),))
M_VALUES = (1, 8, 32, 64, 128, 256, 512, 2048, 8192)
BLOCK = 128
OUT = torch.bfloat16


@dataclasses.dataclass
class Weights:
    """One linear in every format; each list holds `copies` clones (timing rotates over them,
    checks read clone 0)."""

    bf16: list[torch.Tensor]
    bias: torch.Tensor | None
    tensor: list[torch.Tensor]
    tensor_scale: torch.Tensor
    channel: list[torch.Tensor]
    channel_scale: torch.Tensor  # [N]
    block: list[torch.Tensor]
    block_scale: torch.Tensor  # [ceil(N / 128), KB]
    block_scale_rows: torch.Tensor  # [N, KB]


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor
    tensor: torch.Tensor
    tensor_scale: torch.Tensor
    token: torch.Tensor
    token_scale: torch.Tensor  # [M, 1]
    group: torch.Tensor
    group_scale: torch.Tensor  # [M, KB]
    gate_up: torch.Tensor  # [M, 2K] bf16, the input of silu_and_mul_fp8


def make_weights(lin: Linear, device: torch.device, l2_bytes: int) -> Weights:
    from common.model.quantization import fp8_ops as ops

    w = torch.randn(lin.n, lin.k, device=device) * 0.02
    bias = torch.randn(lin.n, device=device).to(OUT) if lin.bias else None
    tq, ts = ops.quantize_weight_per_tensor(w)
    cq, cs = ops.quantize_weight_per_channel(w)
    bq, bs = ops.quantize_weight_blocks(w, (BLOCK, BLOCK))
    rows = bs.repeat_interleave(BLOCK, dim=0)[: lin.n].contiguous()
    wb = w.to(OUT)
    del w
    # As many clones in every format, enough for the FP8 ones to exceed 3x the L2.
    copies = max(1, min(32, math.ceil(3 * l2_bytes / (lin.n * lin.k))))

    def clones(t: torch.Tensor) -> list[torch.Tensor]:
        return [t] + [t.clone() for _ in range(copies - 1)]

    return Weights(
        clones(wb), bias, clones(tq), ts, clones(cq), cs.reshape(-1), clones(bq), bs, rows
    )


def make_inputs(m: int, k: int, device: torch.device) -> Inputs:
    from common.model.quantization import fp8_ops as ops

    x = torch.randn(m, k, device=device).to(OUT)
    static = ops.dynamic_scale(x.abs().amax())  # a calibrated static scale, in effect
    token, token_scale = ops.quantize_per_token(x)
    group, group_scale = ops.quantize_per_token_group(x, BLOCK)
    gate_up = torch.randn(m, 2 * k, device=device).to(OUT)
    return Inputs(
        x,
        ops.quantize_per_tensor(x, static),
        static,
        token,
        token_scale,
        group,
        group_scale,
        gate_up,
    )


# A candidate: run(weights, inputs, clone) -> output, and the float32 reference of clone 0.
Run = Callable[[Weights, Inputs, int], torch.Tensor]
Ref = Callable[[Weights, Inputs], torch.Tensor]
F32 = torch.float32
ALL_M = (1, 1 << 62)


@dataclasses.dataclass(frozen=True)
class Candidate:
    run: Run
    ref: Ref
    m_range: tuple[int, int] = ALL_M  # timed only for M in this closed range


def candidates(sweep: list[tuple[str, object, tuple[int, int]]]) -> dict[str, Candidate]:
    from common.model.kernels import fp8_gemm_kernels as kern
    from common.model.quantization import fp8_gemm as gemm

    def bf16(w, x, i):
        return F.linear(x.x, w.bf16[i], w.bias)

    def ref_bf16(w, x):
        bias = None if w.bias is None else w.bias.float()
        return F.linear(x.x.float(), w.bf16[0].float(), bias)

    def tensor(fn, out=OUT):
        return lambda w, x, i: fn(
            x.tensor, x.tensor_scale, w.tensor[i], w.tensor_scale, out, w.bias
        )

    def channel(fn, out=OUT):
        return lambda w, x, i: fn(
            x.token, x.token_scale, w.channel[i], w.channel_scale, out, w.bias
        )

    def cublas_block(xq, xs, wq, rows, group, out, bias, w_block_scales):
        return gemm.block_scaled_mm_linear(xq, xs, wq, w_block_scales, out, bias)

    ref_tensor = functools.partial(tensor(gemm.reference_linear, F32), i=0)
    ref_channel = functools.partial(channel(gemm.reference_linear, F32), i=0)
    table = {
        "bf16": Candidate(bf16, ref_bf16),
        "tensor_mm": Candidate(tensor(gemm.scaled_mm_linear), ref_tensor),
        "rowwise_mm": Candidate(channel(gemm.scaled_mm_linear), ref_channel),
        "triton_chan": Candidate(channel(kern.w8a8_channel_mm), ref_channel),
        "unit_mm_epi": Candidate(channel(gemm.unit_scale_mm_linear), ref_channel),
        "triton_block": Candidate(triton_block(kern.w8a8_block_mm, None), ref_block),
        "block_mm": Candidate(block_scaled_mm(cublas_block), ref_block),
        "dispatch": Candidate(channel(gemm.fp8_linear), ref_channel),
        "block_disp": Candidate(block_scaled_mm(gemm.block_fp8_linear_cuda), ref_block),
    }
    table.update(quantization_candidates(channel, ref_channel))
    for label, config, m_range in sweep:
        chan = functools.partial(kern.w8a8_channel_mm, config=config)
        table[f"chan[{label}]"] = Candidate(channel(chan), ref_channel, m_range)
        block = triton_block(kern.w8a8_block_mm, config)
        table[f"block[{label}]"] = Candidate(block, ref_block, m_range)
    return table


def quantization_candidates(channel, ref_channel) -> dict[str, Candidate]:
    """The per-token activation quantization: before the dispatched GEMM (from bf16), and
    alone on each path (`fp8_quant.TOKEN_PATHS`), checked on its FP8 codes."""
    from common.model.kernels import fp8_quant, fused_ops
    from common.model.quantization import fp8_gemm as gemm
    from common.model.quantization import fp8_ops as ops
    from common.model.quantization.activation import ActivationQuant

    token = ActivationQuant("token")

    def quantized_disp(path):
        def run(w, x, i):
            act = fp8_quant.quantize_fp8(x.x, token, path)
            return gemm.fp8_linear(act.data, act.scale, w.channel[i], w.channel_scale, OUT, w.bias)

        return run

    def alone(silu, path):
        if silu:
            return lambda w, x, i: fp8_quant.silu_and_mul_fp8(x.gate_up, token, path).data
        return lambda w, x, i: fp8_quant.quantize_fp8(x.x, token, path).data

    def codes(silu):
        def ref(w, x):
            source = fused_ops.silu_and_mul(x.gate_up) if silu else x.x
            return ops.quantize_per_token(source)[0].float()

        return ref

    table = {
        "quant_disp": Candidate(quantized_disp(None), ref_channel),
        "q_row_disp": Candidate(quantized_disp("row"), ref_channel),
    }
    for path in fp8_quant.TOKEN_PATHS:
        table[f"quant[{path}]"] = Candidate(alone(False, path), codes(False))
        table[f"silu[{path}]"] = Candidate(alone(True, path), codes(True))
    return table


def triton_block(kernel, config) -> Run:
    def run(w: Weights, x: Inputs, i: int) -> torch.Tensor:
        scales = (x.group_scale, w.block[i], w.block_scale_rows)
        return kernel(x.group, *scales, BLOCK, OUT, w.bias, config)

    return run


def ref_block(w: Weights, x: Inputs) -> torch.Tensor:
    from common.model.quantization import fp8_ops as ops
    from common.model.quantization.fp8_gemm import reference_linear

    k = x.x.shape[1]
    xs = ops.expand_groups(x.group_scale, BLOCK, k)
    ws = ops.expand_groups(w.block_scale_rows, BLOCK, k)
    return reference_linear(x.group, xs, w.block[0], ws, F32, w.bias)


def sweep_configs() -> list[tuple[str, object, tuple[int, int]]]:
    """Tile variants around the table's decode and prefill entries, each timed only in its own
    range of M. Labels: BMxBN, kK per iteration (block-scaled: 256 = two groups), wWARPS,
    sSTAGES, swap (operands swapped), 1split (no split-K), p32 (promote every 32 columns)."""
    from common.model.kernels.fp8_gemm_kernels import TileConfig as T

    decode = [
        ("16x64 k256 w4 s4 swap", T(16, 64, 256, 4, 4, True)),
        ("16x64 k256 w4 s4 swap p32", T(16, 64, 256, 4, 4, True, promote_k=32)),
        ("16x64 k256 w4 s4 swap 1split", T(16, 64, 256, 4, 4, True, 1)),
        ("16x128 k256 w4 s3 swap", T(16, 128, 256, 4, 3, True)),
        ("16x128 k256 w4 s4 swap", T(16, 128, 256, 4, 4, True)),
        ("16x128 k128 w4 s5 swap", T(16, 128, 128, 4, 5, True)),
        ("16x256 k256 w8 s3 swap", T(16, 256, 256, 8, 3, True)),
        ("16x64 k256 w4 s4", T(16, 64, 256, 4, 4, False)),
        ("16x64 k256 w4 s6", T(16, 64, 256, 4, 6, False)),
        ("16x128 k256 w4 s4", T(16, 128, 256, 4, 4, False)),
        ("16x32 k256 w4 s6", T(16, 32, 256, 4, 6, False)),
        ("32x64 k256 w4 s4 swap", T(32, 64, 256, 4, 4, True)),
        ("64x64 k128 w4 s4 swap", T(64, 64, 128, 4, 4, True)),
        ("64x64 k256 w4 s3 swap", T(64, 64, 256, 4, 3, True)),
        ("64x128 k256 w4 s3 swap", T(64, 128, 256, 4, 3, True)),
        ("64x64 k128 w4 s4", T(64, 64, 128, 4, 4, False)),
    ]
    prefill = [
        ("64x128 k128 w4 s3", T(64, 128, 128, 4, 3, False)),
        ("64x128 k256 w4 s3", T(64, 128, 256, 4, 3, False)),
        ("128x128 k128 w4 s3", T(128, 128, 128, 4, 3, False)),
        ("128x128 k128 w8 s4", T(128, 128, 128, 8, 4, False)),
        ("128x128 k256 w8 s3", T(128, 128, 256, 8, 3, False)),
        ("128x256 k128 w8 s3", T(128, 256, 128, 8, 3, False)),
    ]
    return [(*c, (1, 128)) for c in decode] + [(*c, (64, 2048)) for c in prefill]


def tma_sweep_configs() -> list[tuple[str, object, tuple[int, int]]]:
    """Decode tiles reading the weights through TMA, against the table's per-thread loads:
    for M <= 32 with the operands swapped, split-K left to `split_k_for` or fixed (sN; at M = 1
    a gate_up of 592 64-row tiles fills 132 SMs in uneven waves unless K is split); for the
    33-128 buckets 64-row tiles, swapped or not."""
    from common.model.kernels.fp8_gemm_kernels import TileConfig as T

    def t(bm, bn, bk, warps, stages, split=0, tma=True):
        return T(bm, bn, bk, warps, stages, True, split, tma=tma)

    configs = [
        ("16x64 k256 w4 s4", t(16, 64, 256, 4, 4, tma=False)),
        ("16x128 k256 w4 s3", t(16, 128, 256, 4, 3, tma=False)),
        ("16x64 k256 w4 s4 tma", t(16, 64, 256, 4, 4)),
        ("16x64 k256 w4 s6 tma", t(16, 64, 256, 4, 6)),
        ("16x64 k128 w4 s8 tma", t(16, 64, 128, 4, 8)),
        ("16x128 k256 w4 s3 tma", t(16, 128, 256, 4, 3)),
        ("16x128 k256 w4 s4 tma", t(16, 128, 256, 4, 4)),
        ("16x128 k128 w4 s6 tma", t(16, 128, 128, 4, 6)),
        ("16x256 k128 w8 s4 tma", t(16, 256, 128, 8, 4)),
        ("16x64 k256 w4 s4 tma s1", t(16, 64, 256, 4, 4, 1)),
        ("16x64 k256 w4 s4 tma s2", t(16, 64, 256, 4, 4, 2)),
        ("16x64 k256 w4 s4 tma s4", t(16, 64, 256, 4, 4, 4)),
        ("16x128 k256 w4 s4 tma s2", t(16, 128, 256, 4, 4, 2)),
        ("16x128 k256 w4 s4 tma s4", t(16, 128, 256, 4, 4, 4)),
        ("32x64 k256 w4 s4 tma", t(32, 64, 256, 4, 4)),
        ("32x128 k256 w4 s3 tma", t(32, 128, 256, 4, 3)),
    ]
    wider = [  # the 33-128 row buckets: 64-row tiles, swapped or not
        ("64x64 k128 w4 s4 swap", T(64, 64, 128, 4, 4, True)),
        ("64x64 k128 w4 s4", T(64, 64, 128, 4, 4, False)),
        ("64x64 k128 w4 s4 swap tma", T(64, 64, 128, 4, 4, True, tma=True)),
        ("64x64 k256 w4 s3 swap tma", T(64, 64, 256, 4, 3, True, tma=True)),
        ("64x64 k128 w4 s4 tma", T(64, 64, 128, 4, 4, False, tma=True)),
        ("64x128 k128 w4 s4 tma", T(64, 128, 128, 4, 4, False, tma=True)),
        ("64x128 k256 w8 s3 tma", T(64, 128, 256, 8, 3, False, tma=True)),
    ]
    return [(*c, (1, 32)) for c in configs] + [(*c, (33, 128)) for c in wider]


def block_scaled_mm(fn) -> Run:
    def run(w: Weights, x: Inputs, i: int) -> torch.Tensor:
        scales = (x.group_scale, w.block[i], w.block_scale_rows, BLOCK)
        return fn(x.group, *scales, OUT, w.bias, w_block_scales=w.block_scale)

    return run


class Timer:
    """Per-call times of `calls` back-to-back calls: CUDA graph and eager on a GPU (events),
    eager alone on a CPU (perf_counter)."""

    def __init__(self, device: torch.device, reps: int, min_calls: int) -> None:
        self.cuda = device.type == "cuda"
        self.reps = reps
        self.min_calls = min_calls

    def graph_ms(self, loop: Callable[[], None], calls: int) -> float | None:
        if not self.cuda:
            return None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            loop()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loop()
        graph.replay()
        times = self._events(graph.replay)
        del graph
        return statistics.median(times) / calls

    def eager_ms(self, loop: Callable[[], None], calls: int) -> float:
        if not self.cuda:  # the --smoke run: nothing to warm up (no compile, no caches to fill)
            times = []
            for _ in range(self.reps):
                start = time.perf_counter()
                loop()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times) / calls
        loop()
        return statistics.median(self._events(loop)) / calls

    def _events(self, fn: Callable[[], None]) -> list[float]:
        torch.cuda.synchronize()
        pairs = []
        for _ in range(self.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in pairs]


def measure(cand: Candidate, w: Weights, x: Inputs, timer: Timer, tol: float) -> dict:
    """One candidate on one (linear, M): check first, then time."""
    try:
        expected = cand.ref(w, x)
        err = (cand.run(w, x, 0).float() - expected).abs().max().item()
        err /= expected.abs().max().item() or 1.0
        del expected
        if not err <= tol:  # NaN fails too
            return {"status": "wrong", "max_rel_err": err}
        copies = len(w.channel)  # every format holds as many clones
        calls = copies * math.ceil(timer.min_calls / copies)

        def loop() -> None:
            for c in range(calls):
                cand.run(w, x, c % copies)

        graph = timer.graph_ms(loop, calls)
        eager = timer.eager_ms(loop, calls)
        return {"status": "ok", "max_rel_err": err, "graph_ms": graph, "eager_ms": eager}
    except Exception as exc:  # noqa: BLE001 - one candidate's failure must not lose the table
        return {"status": "unavailable", "error": f"{type(exc).__name__}: {exc}"[:400]}


def run_model(model, ms, cands, device, timer, tol, l2_bytes, rounds) -> list[dict]:
    """Every candidate on every (linear, M), `rounds` times in alternating order; a time is
    the fastest round's (identical calls drifted up to ~20% between neighbours in one pass on
    an H200)."""
    rows, reported = [], set()
    for lin in model.linears:
        w = make_weights(lin, device, l2_bytes)
        for m in ms:
            x = make_inputs(m, lin.k, device)
            names = [n for n, c in cands.items() if c.m_range[0] <= m <= c.m_range[1]]
            results: dict[str, dict] = {}
            for r in range(rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    results[name] = _merge(
                        results.get(name), measure(cands[name], w, x, timer, tol)
                    )
            for name in names:
                where = {"model": model.name, "layer": lin.name, "n": lin.n, "k": lin.k, "m": m}
                rows.append({**where, "candidate": name, **results[name]})
                status = results[name]["status"]
                if status != "ok" and (name, status) not in reported:
                    reported.add((name, status))  # the first failure of each kind
                    print(f"{name} {status} ({where}): {results[name]}", file=sys.stderr)
            del x
        del w
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _merge(old: dict | None, new: dict) -> dict:
    """A failure in any round stands; else the faster time of each kind, the larger error."""
    if old is None or old["status"] != "ok":
        return new if old is None else old
    if new["status"] != "ok":
        return new
    merged = {"status": "ok", "max_rel_err": max(old["max_rel_err"], new["max_rel_err"])}
    for key in ("graph_ms", "eager_ms"):
        times = [t for t in (old[key], new[key]) if t is not None]
        merged[key] = min(times) if times else None
    return merged


def summarize(model, ms, names, rows) -> dict:
    """Per M and candidate: one call of every linear x layers, in ms (None if any failed)."""
    summary = {}
    for m in ms:
        per = {}
        for name in names:
            mine = [r for r in rows if r["m"] == m and r["candidate"] == name]
            entry = {}
            for key in ("graph_ms", "eager_ms"):
                ok = len(mine) == len(model.linears) and all(r.get(key) is not None for r in mine)
                entry[key] = model.layers * sum(r[key] for r in mine) if ok else None
            per[name] = entry
        for entry in per.values():
            for key in ("graph_ms", "eager_ms"):
                base, mine = per["bf16"][key], entry[key]
                entry[key.replace("_ms", "_speedup")] = base / mine if base and mine else None
        summary[m] = per
    return summary


def print_table(model, summary, names, key) -> None:
    linears = ", ".join(lin.name for lin in model.linears)
    print(f"\n{model.name}: {model.layers} layers x ({linears}), {key}: ms (speedup vs bf16)")
    print(f"{'M':>6} " + " ".join(f"{n[:16]:>17}" for n in names))
    for m, per in summary.items():
        cells = []
        for name in names:
            ms, speedup = per[name][f"{key}_ms"], per[name][f"{key}_speedup"]
            cells.append("n/a" if ms is None else f"{ms:.3f} ({speedup:.2f}x)")
        print(f"{m:>6} " + " ".join(f"{c:>17}" for c in cells))


def print_quant_table(model, rows, ms, key) -> None:
    """Per step, the standalone quantization the model launches: o_proj's input
    (quant[PATH] at o's K) and down_proj's (silu[PATH] at down's K), times the layers."""
    paths = sorted({r["candidate"][6:-1] for r in rows if r["candidate"].startswith("quant[")})
    if not paths:
        return
    print(f"\n{model.name}: per-token quantization of o and down inputs x {model.layers}, {key}")
    print(f"{'M':>6} " + " ".join(f"{p:>12}" for p in paths))
    for m in ms:
        cells = []
        for path in paths:
            want = {("o", f"quant[{path}]"), ("down", f"silu[{path}]")}
            mine = [r for r in rows if r["m"] == m and (r["layer"], r["candidate"]) in want]
            times = [r.get(f"{key}_ms") for r in mine]
            ok = len(mine) == 2 and None not in times
            cells.append(f"{model.layers * sum(times):.3f}" if ok else "n/a")
        print(f"{m:>6} " + " ".join(f"{c:>12}" for c in cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--m", type=int, nargs="+", default=list(M_VALUES))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tol", type=float, default=1e-2, help="max |out - ref| / max |ref|")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the candidates")
    ap.add_argument("--sweep", action="store_true", help="also Triton tile-config variants")
    ap.add_argument(
        "--tma-sweep", action="store_true", help="also decode tiles with TMA and fixed splits"
    )
    ap.add_argument("--only", help="regex: time only the candidates it matches (bf16 is kept)")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET, tiny shapes")
    ap.add_argument("--out", type=Path, default=Path("fp8_linear.json"))
    args = ap.parse_args()
    if args.smoke and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        ap.error("no GPU: run with --smoke")
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 references stay float32
    models = [SMOKE] if args.smoke else [MODELS[name] for name in args.models]
    ms = (1, 33) if args.smoke else args.m
    reps = 1 if args.smoke else args.reps
    cuda = device.type == "cuda"
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size if cuda else 0
    sweep = (sweep_configs() if args.sweep else []) + (
        tma_sweep_configs() if args.tma_sweep else []
    )
    cands = candidates(sweep)
    if args.only:
        cands = {n: c for n, c in cands.items() if n == "bf16" or re.search(args.only, n)}
    names = list(cands)
    timer = Timer(device, reps, min_calls=1 if args.smoke else 8)
    report = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu (interpreted)",
        "torch": torch.__version__,
        "timing": "per call; graph = CUDA graph replay of back-to-back calls over rotating weight "
        "clones (> 3x L2), median of reps; eager = the same loop launched from Python",
        "reps": reps,
        "tol": args.tol,
        "models": {},
        "detail": [],
    }
    with torch.inference_mode():
        for model in models:
            try:
                rounds = 1 if args.smoke else args.rounds
                rows = run_model(model, ms, cands, device, timer, args.tol, l2_bytes, rounds)
            except Exception:  # noqa: BLE001 - e.g. out of memory: keep the other model
                traceback.print_exc()
                continue
            summary = summarize(model, ms, names, rows)
            report["models"][model.name] = {"layers": model.layers, "per_m": summary}
            report["detail"] += rows
            main_names = [n for n in names if "[" not in n]  # no sweep, no quantization alone
            for key in ("graph", "eager") if cuda else ("eager",):
                print_table(model, summary, main_names, key)
                print_quant_table(model, rows, ms, key)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(
                json.dumps(report, indent=1)
            )  # after each model: a cut run keeps it
    wrong = [r for r in report["detail"] if r["status"] == "wrong"]
    for r in wrong:
        where = f"{r['model']} {r['layer']} M={r['m']} {r['candidate']}"
        print(f"WRONG: {where}: max rel err {r['max_rel_err']:.3g} > {args.tol}", file=sys.stderr)
    print(f"\nwrote {args.out}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
