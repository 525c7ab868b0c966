"""MoE expert computation microbenchmark: `fused_moe`'s paths on one MoE layer of Qwen3-30B-A3B,
Mixtral-8x7B and DeepSeek-V2-Lite (DeepSeek-V3 on request: 22 GB a layer), against the memory
floor and the matmul rate; at decode sizes the whole layer too (router + plan + experts, with
the fused and with torch's router: `benchmarks/moe_layer_bench.py`).

    python benchmarks/bench_moe.py [--models ...] [--tokens 1 8 32 ...] [--reps 30] [--sweep]
        [--out moe.json]
    python benchmarks/bench_moe.py --smoke [--out x.json]   # CPU, TRITON_INTERPRET, tiny

Impls: reference (the float32 expert loop; it syncs, so it runs eagerly, T <= 128 only),
grouped_mm, triton (`pick_config`'s choice: GEMVs up to `GEMV_MAX_TOKENS` tokens, grouped GEMMs
beyond); --sweep adds each of `sweep_configs()` (grouped GEMM tiles as triton[...], GEMV tiles as
gemv[...] up to GEMV_SWEEP_MAX_TOKENS) and times the routing plan in one launch and in two.
Each GPU path is timed as the replay of one CUDA graph of back-to-back calls whose weights
rotate over enough copies of the layer to exceed 3x the L2 (a call never finds its experts
cached), per call, median of --reps replays. Routing is uniform: top-k of random logits.

Floors, from ceilings measured in the same run (`benchmarks/roofline.py`): floor_us = the bytes
of the experts the routing touches (unique ids x 3 H I x 2 bytes) at the copy rate of a big D2D
copy (bytes read + written); matmul_frac = active FLOPs (6 T k H I) per second over the rate of
an 8192^3 bf16 matmul. Every output is checked against the reference: max |out - ref| /
max |ref| beyond --tol fails the run (exit 1) after the table. One JSON document is printed
and written to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.moe_layer_bench import print_layer_table  # noqa: E402
from benchmarks.roofline import measure_ceilings, time_fn  # noqa: E402


@dataclasses.dataclass(frozen=True)
class MoEShape:
    experts: int
    top_k: int
    hidden: int
    inter: int
    rules: tuple[tuple[str, object], ...] = ()  # MoESpec routing fields off their defaults

    def spec(self):
        from common.model.spec import MoESpec

        return MoESpec(self.experts, self.top_k, self.inter, **dict(self.rules))


V3_RULES = (("scoring", "sigmoid"), ("num_groups", 8), ("topk_groups", 4),
            ("group_score", "top2_sum"), ("correction_bias", True), ("routed_scaling", 2.5))  # fmt: skip
MODELS = {
    "qwen3-30b-a3b": MoEShape(128, 8, 2048, 768),
    "mixtral-8x7b": MoEShape(8, 2, 4096, 14336),
    "deepseek-v2-lite": MoEShape(64, 6, 2048, 1408, (("renormalize", False),)),
    "deepseek-v3": MoEShape(256, 8, 7168, 2048, V3_RULES),
}
DEFAULT_MODELS = ["qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"]
SMOKE = {"tiny": MoEShape(8, 2, 64, 32)}
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
REFERENCE_MAX_TOKENS = 128
GEMV_SWEEP_MAX_TOKENS = 32  # beyond, every pair reading its expert alone is hopeless
MIN_IDS_MATCH = 0.99  # rows whose experts the fused router picks as torch's does (near-ties)


def sweep_configs() -> dict[str, object]:
    """Grouped GEMM tiles, label triton[BM/gate_up BNxBK wW sS/down ...(/gG: group_m)], and
    GEMV tiles, label gemv[gate_up BNxBK wW sS/down ...]; as given, no narrowing."""
    from common.model.kernels.fused_moe import GemmTiles as G
    from common.model.kernels.fused_moe import GemvConfig, GemvTiles, MoEConfig

    shapes = [  # (block_m, gate_up, down, group_m)
        (16, G(32, 128, 4, 4), G(32, 128, 4, 4), 8),
        (16, G(64, 128, 4, 4), G(64, 128, 4, 4), 8),
        (16, G(64, 256, 4, 3), G(64, 256, 4, 3), 8),
        (16, G(128, 128, 4, 3), G(128, 128, 4, 3), 8),
        (32, G(64, 128, 4, 4), G(64, 128, 4, 4), 8),
        (64, G(64, 64, 4, 4), G(128, 64, 4, 4), 8),
        (64, G(128, 64, 8, 4), G(128, 64, 8, 4), 8),
        (64, G(256, 64, 8, 3), G(256, 64, 8, 3), 8),
        (128, G(64, 64, 8, 4), G(128, 64, 8, 4), 8),
        (128, G(64, 128, 8, 3), G(128, 128, 8, 3), 8),
        (128, G(128, 64, 8, 4), G(128, 64, 8, 4), 8),
        (128, G(128, 64, 8, 4), G(256, 64, 8, 4), 8),
        *[(128, G(128, 64, 8, 3), G(256, 64, 8, 3), g) for g in (1, 4, 8, 16, 64)],
    ]  # shared memory <= 227 KB each (sm90)
    tails = [  # (block_m, gate_up, down, tail_m): an expert's last block multiplies tail_m rows
        (128, G(128, 64, 8, 3), G(256, 64, 8, 3), 64),
        (128, G(128, 64, 8, 3), G(256, 64, 8, 3), 32),
        (128, G(128, 64, 8, 3), G(256, 64, 8, 3), 16),
        (64, G(128, 64, 8, 4), G(128, 64, 8, 4), 32),
        (64, G(128, 64, 8, 4), G(128, 64, 8, 4), 16),
    ]
    gemvs = [  # (gate_up, down)
        (GemvTiles(16, 256, 4, 3), GemvTiles(8, 512, 4, 4)),  # the default, narrowed at T = 1
        (GemvTiles(16, 256, 4, 3), GemvTiles(16, 256, 4, 3)),
        (GemvTiles(8, 256, 4, 3), GemvTiles(8, 256, 4, 4)),
        (GemvTiles(4, 512, 4, 3), GemvTiles(4, 512, 4, 4)),
        (GemvTiles(16, 128, 4, 4), GemvTiles(8, 256, 4, 6)),
        (GemvTiles(32, 128, 4, 3), GemvTiles(16, 256, 4, 4)),
        (GemvTiles(16, 512, 8, 2), GemvTiles(8, 512, 8, 3)),
        (GemvTiles(16, 256, 8, 4), GemvTiles(16, 256, 8, 4)),
    ]

    def label(t) -> str:
        return f"{t.block_n}x{t.block_k}w{t.num_warps}s{t.num_stages}"

    configs: dict[str, object] = {}
    for bm, a, b, g in shapes:
        tail = "" if g == 8 else f"/g{g}"
        configs[f"triton[{bm}/{label(a)}/{label(b)}{tail}]"] = MoEConfig(bm, a, b, g, False)
    for bm, a, b, t in tails:
        configs[f"triton[{bm}/{label(a)}/{label(b)}/t{t}]"] = MoEConfig(bm, a, b, 8, False, t)
    for a, b in gemvs:
        configs[f"gemv[{label(a)}/{label(b)}]"] = GemvConfig(a, b, fill_sms=False)
    return configs


@dataclasses.dataclass
class Layer:
    """`copies` clones of one layer's weights (rotated so no call finds them in L2): experts,
    gate; and the correction bias where the routing has one."""

    w13: list[torch.Tensor]
    w2: list[torch.Tensor]
    gate: list[torch.Tensor]
    bias: torch.Tensor | None


def make_layer(shape: MoEShape, device: torch.device, l2_bytes: int) -> Layer:
    e, h, i = shape.experts, shape.hidden, shape.inter
    expert_bytes = 3 * h * i * 2
    copies = max(1, min(4, math.ceil(3 * l2_bytes / (shape.top_k * expert_bytes))))

    def weight(*size: int) -> torch.Tensor:  # bf16 from the start: a V3 layer is 22 GB
        return torch.randn(*size, device=device, dtype=torch.bfloat16).mul_(size[-1] ** -0.5)

    bias = torch.randn(e, device=device) * 0.1 if shape.spec().correction_bias else None
    return Layer(
        [weight(e, 2 * i, h) for _ in range(copies)],
        [weight(e, h, i) for _ in range(copies)],
        [weight(e, h) for _ in range(copies)],
        bias,
    )


def make_routing(shape: MoEShape, tokens: int, device: torch.device):
    x = torch.randn(tokens, shape.hidden, device=device).bfloat16()
    logits = torch.randn(tokens, shape.experts, device=device)
    top, ids = logits.topk(shape.top_k, dim=1)
    weights = torch.softmax(top, dim=1)
    return x, weights, ids.to(torch.int32)


def graph_us(run: Callable[[int], object], copies: int, calls: int, reps: int) -> float:
    """Per call, median replay of one CUDA graph of `calls` calls over rotating copies."""

    def loop() -> None:
        for c in range(calls):
            run(c % copies)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        loop()  # compiles, and warms the allocator outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loop()
    seconds = time_fn(graph.replay, reps, cuda=True)
    del graph
    return seconds * 1e6 / calls


def eager_us(run: Callable[[int], object], copies: int, reps: int, cuda: bool) -> float:
    seconds = time_fn(lambda: [run(c) for c in range(copies)], reps, cuda, warmup=1)
    return seconds * 1e6 / copies


def bench_model(name, shape, tokens_list, impls, args, device, ceilings):
    """(expert rows, layer and plan rows) of one model at every T."""
    from benchmarks.moe_layer_bench import LAYER_MAX_TOKENS, bench_layer, bench_plan
    from common.model.kernels import fused_moe as fm

    cuda = device.type == "cuda"
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if cuda else 0
    layer = make_layer(shape, device, l2)
    copies = len(layer.w13)

    def timer(run: Callable[[int], object], calls: int) -> float:
        if cuda:
            return graph_us(run, copies, copies * max(1, math.ceil(calls / copies)), args.reps)
        return eager_us(run, copies, args.reps, cuda)

    rows, pieces = [], []
    for tokens in tokens_list:
        inputs = make_routing(shape, tokens, device)
        rows += [{"model": name, **row} for row in bench_tokens(shape, layer, inputs, impls, args, ceilings)]  # fmt: skip
        if tokens <= LAYER_MAX_TOKENS:
            found = bench_layer(shape, layer, inputs[0], timer, ceilings["copy"])
            pieces += [{"model": name, **row} for row in found]
        if args.sweep:
            config = fm.pick_config(tokens, shape.top_k, layer.w13[0])
            block_m = getattr(config, "block_m", 16)  # the GEMVs need no plan
            pieces += [{"model": name, **r} for r in bench_plan(shape, inputs[2], block_m, timer)]
        if cuda:
            torch.cuda.empty_cache()
    return rows, pieces


def bench_tokens(shape, layer, inputs, impls, args, ceilings) -> list[dict]:
    """Every impl at one T: checked against the reference, then timed."""
    from common.model.kernels import fused_moe as fm

    x, weights, ids = inputs
    tokens, copies, cuda = x.shape[0], len(layer.w13), x.device.type == "cuda"
    ref = fm.moe_reference(x, layer.w13[0], layer.w2[0], weights, ids).float()
    touched = ids.unique().numel()
    common = {
        "tokens": tokens,
        "touched_experts": touched,
        "floor_us": touched * 3 * shape.hidden * shape.inter * 2 / ceilings["copy"] * 1e6,
    }
    flops = 6 * tokens * shape.top_k * shape.hidden * shape.inter
    calls = copies * max(1, math.ceil((8 if tokens <= 128 else 1) / copies))
    rows = []
    for impl, fn in impls.items():
        if impl == "reference" and tokens > REFERENCE_MAX_TOKENS:
            continue
        if impl.startswith("gemv[") and tokens > GEMV_SWEEP_MAX_TOKENS:
            continue
        row = {"impl": impl, **common}
        try:
            out = fn(x, layer.w13[0], layer.w2[0], weights, ids).float()
            row["max_rel_err"] = ((out - ref).abs().max() / ref.abs().max()).item()

            def run(c: int, fn=fn) -> object:
                return fn(x, layer.w13[c], layer.w2[c], weights, ids)

            if cuda and impl != "reference":
                row["timing"], us = "graph", graph_us(run, copies, calls, args.reps)
            else:
                row["timing"], us = "eager", eager_us(run, copies, args.reps, cuda)
            row["us"] = us
            row["x_floor"] = us / row["floor_us"]
            row["matmul_frac"] = flops / (us * 1e-6) / ceilings["matmul"]
        except Exception as exc:  # noqa: BLE001 - one impl's failure must not lose the table
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        rows.append(row)
    return rows


def print_table(rows: list[dict], names: list[str]) -> None:
    """Per model and T: each main impl's us, its multiple of the floor and its matmul fraction;
    with --sweep, the best sweep config too."""
    models = dict.fromkeys(r["model"] for r in rows)
    for model in models:
        mine = [r for r in rows if r["model"] == model]
        print(f"\n{model}: us (x floor, % of matmul rate)")
        swept = any(_swept(r) for r in mine)
        heads = names + ["best sweep"] if swept else names
        print(f"{'T':>6} {'floor':>8} " + " ".join(f"{n:>24}" for n in heads))
        for tokens in dict.fromkeys(r["tokens"] for r in mine):
            at = [r for r in mine if r["tokens"] == tokens]
            cells = [_cell(next((r for r in at if r["impl"] == n), None)) for n in names]
            if swept:
                ran = [r for r in at if _swept(r) and "us" in r]
                best = min(ran, key=lambda r: r["us"], default=None)
                cells.append(_cell(best) + (f" {best['impl']}" if best else ""))
            print(f"{tokens:>6} {at[0]['floor_us']:>8.1f} " + " ".join(f"{c:>24}" for c in cells))


def _swept(row: dict) -> bool:
    return row["impl"].startswith(("triton[", "gemv["))


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if "us" not in row:
        return "failed"
    return f"{row['us']:.1f} ({row['x_floor']:.2f}x, {100 * row['matmul_frac']:.0f}%)"


def _failed(row: dict, tol: float) -> bool:
    """A wrong output anywhere, or a main impl that did not run (a sweep config may not fit);
    a layer or plan row: a wrong output, or plans that differ."""
    if row["impl"] == "reference":
        return False
    if row.get("kind") == "router":
        return not row["ids_match"] >= MIN_IDS_MATCH
    if row.get("kind") == "plan":
        return not row["plans_equal"]
    if "error" in row:
        return not _swept(row)
    return not row["max_rel_err"] <= tol  # NaN fails too


def cpu_ceilings() -> dict[str, float]:
    """Smoke run's stand-ins (the interpreter's times mean nothing)."""
    src = torch.randn(1 << 22)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() * 4 / time_fn(lambda: dst.copy_(src), 3, False)
    a = torch.randn(256, 256)
    return {"copy": copy, "matmul": 2 * 256**3 / time_fn(lambda: a @ a, 3, False)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS))
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tol", type=float, default=2e-2, help="max |out - ref| / max |ref|")
    ap.add_argument("--sweep", action="store_true", help="also triton with each SWEEP config")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET, tiny shapes")
    ap.add_argument("--out", type=Path, default=Path("moe.json"))
    args = ap.parse_args()
    if args.smoke and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    from common.model.kernels import fused_moe as fm

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        ap.error("no GPU: run with --smoke")
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    if device.type == "cuda":
        measured = measure_ceilings()
        ceilings = {"copy": measured["copy_bytes_per_s"], "matmul": measured["bf16_flops_per_s"]}
    else:
        ceilings = cpu_ceilings()
    models = SMOKE if args.smoke else {name: MODELS[name] for name in args.models}
    tokens = (1, 5) if args.smoke else args.tokens
    if args.smoke:
        args.reps = 1
    impls: dict[str, Callable] = {
        "reference": fm.moe_reference,
        "grouped_mm": fm.fused_moe_grouped_mm,
        "triton": fm.fused_moe_triton,
    }
    if args.sweep:
        for label, config in sweep_configs().items():
            impls[label] = lambda *a, config=config: fm.fused_moe_triton(*a, config=config)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "ceilings": {"copy_bytes_per_s": ceilings["copy"], "bf16_flops_per_s": ceilings["matmul"]},
        "timing": "per call; graph = CUDA graph replay of back-to-back calls over rotating "
        "weight copies (> 3x L2), median of reps; eager (reference) = launched from Python",
        "reps": args.reps,
        "tol": args.tol,
        "auto_impl": [[top if math.isfinite(top) else None, impl] for top, impl in fm.AUTO_IMPL],
        "rows": [],
        "layer_rows": [],
    }
    started = time.perf_counter()
    with torch.inference_mode():
        for name, shape in models.items():
            try:
                rows, pieces = bench_model(name, shape, tokens, impls, args, device, ceilings)
                report["rows"] += rows
                report["layer_rows"] += pieces
            except Exception:  # noqa: BLE001 - e.g. out of memory: keep the other models
                traceback.print_exc()
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(
                json.dumps(report, indent=1)
            )  # after each model: a cut run keeps it
    report["seconds"] = time.perf_counter() - started
    print(json.dumps(report))
    print_table(report["rows"], ["reference", "grouped_mm", "triton"])
    print_layer_table(report["layer_rows"])
    args.out.write_text(json.dumps(report, indent=1))
    bad = [r for r in report["rows"] + report["layer_rows"] if _failed(r, args.tol)]
    for r in bad:
        print(f"WRONG or failed: {r}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
