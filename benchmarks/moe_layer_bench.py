"""`bench_moe.py`'s whole-layer and routing-plan timings.

Layer (decode sizes, T <= LAYER_MAX_TOKENS): router, plan and experts as `MoEBlock` runs them on
CUDA (no shared experts, no all-reduce), once with the fused router (`moe_router.route`, one
launch) and once with torch's (float32 `F.linear`, then `select_experts`: ~10 launches), in the
same run; the two routers alone too. Floors at the copy rate: the gate weight's bytes (routers),
plus the bytes of the experts the routing touches (layers). Each layer's output is checked
against the float32 expert loop on its own routing, each router's ids against torch's, as sets
per row (`ids_match`: the fraction of rows that agree; near-ties may differ).

Plan (--sweep): `moe_align` in one program and in two launches, at the block_m the tile table
picks for T (16 where the GEMVs need no plan).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LAYER_MAX_TOKENS = 128
PLAN_MAX_PAIRS = 8192
# (run(copy index), calls) -> us per call; bench_moe's CUDA-graph timer on a GPU.
Timer = Callable[[Callable[[int], object], int], float]


def routers(spec) -> dict[str, Callable]:
    """name -> (x, gate weight, bias) -> (weights, ids)."""
    from common.model.kernels.moe_router import route
    from common.model.layers.moe_routing import select_experts

    def torch_router(x, gate, bias):
        return select_experts(F.linear(x.float(), gate.float()), spec, bias)

    def fused_router(x, gate, bias):
        return route(x, gate, spec, bias)

    return {"torch router": torch_router, "fused router": fused_router}


def bench_layer(shape, layer, x: torch.Tensor, timer: Timer, copy_rate: float) -> list[dict]:
    """Rows "router[name]" and "layer[name]" for each router at x's T."""
    from common.model.kernels import fused_moe as fm

    spec = shape.spec()
    paths = routers(spec)
    _, ref_ids = paths["torch router"](x, layer.gate[0], layer.bias)
    gate_bytes = layer.gate[0].numel() * layer.gate[0].element_size()
    touched = ref_ids.unique().numel()
    expert_bytes = touched * 3 * shape.hidden * shape.inter * layer.w13[0].element_size()
    tokens, calls = x.shape[0], 8
    rows = []
    for name, router in paths.items():
        weights, ids = router(x, layer.gate[0], layer.bias)
        same = (ids.long().sort(1).values == ref_ids.long().sort(1).values).all(1)
        out = fm.experts_forward(x, layer.w13[0], layer.w2[0], weights, ids).float()
        ref = fm.moe_reference(x, layer.w13[0], layer.w2[0], weights, ids).float()

        def route_only(c: int, router=router) -> object:
            return router(x, layer.gate[c], layer.bias)

        def whole(c: int, router=router) -> object:
            w, i = router(x, layer.gate[c], layer.bias)
            return fm.experts_forward(x, layer.w13[c], layer.w2[c], w, i)

        for kind, run, floor_bytes in (
            ("router", route_only, gate_bytes),
            ("layer", whole, gate_bytes + expert_bytes),
        ):
            row = {"kind": kind, "impl": f"{kind}[{name}]", "tokens": tokens,
                   "touched_experts": touched, "floor_us": floor_bytes / copy_rate * 1e6,
                   "ids_match": same.float().mean().item()}  # fmt: skip
            if kind == "layer":
                row["max_rel_err"] = ((out - ref).abs().max() / ref.abs().max()).item()
            row["us"] = timer(run, calls)
            row["x_floor"] = row["us"] / row["floor_us"]
            rows.append(row)
    return rows


def bench_plan(shape, ids: torch.Tensor, block_m: int, timer: Timer) -> list[dict]:
    """Rows "plan[1 launch]" and "plan[2 launches]" of `moe_align(ids)`, checked equal."""
    from common.model.kernels.moe_align import moe_align

    if ids.numel() > PLAN_MAX_PAIRS:
        return []
    one = moe_align(ids, shape.experts, block_m, one_program=True)
    three = moe_align(ids, shape.experts, block_m, one_program=False)
    equal = all(
        torch.equal(getattr(one, f), getattr(three, f))
        for f in ("sorted_pairs", "block_expert", "pair_rows", "expert_ends")
    )
    rows = []
    for label, flag in (("plan[1 launch]", True), ("plan[2 launches]", False)):
        us = timer(lambda c, flag=flag: moe_align(ids, shape.experts, block_m, one_program=flag), 8)
        rows.append({"kind": "plan", "impl": label, "tokens": ids.shape[0], "block_m": block_m,
                     "pairs": ids.numel(), "plans_equal": equal, "us": us})  # fmt: skip
    return rows


def print_layer_table(rows: list[dict]) -> None:
    """Per model and T: each router alone and each whole layer, us (x floor); the plans' us."""
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        names = list(dict.fromkeys(r["impl"] for r in mine))
        print(f"\n{model}: MoE layer pieces, us (x floor)")
        print(f"{'T':>6} " + " ".join(f"{n:>22}" for n in names))
        for tokens in dict.fromkeys(r["tokens"] for r in mine):
            at = {r["impl"]: r for r in mine if r["tokens"] == tokens}
            print(f"{tokens:>6} " + " ".join(f"{_cell(at.get(n)):>22}" for n in names))


def _cell(row: dict | None) -> str:
    if row is None or "us" not in row:
        return "-"
    if "x_floor" not in row:
        return f"{row['us']:.1f}"
    return f"{row['us']:.1f} ({row['x_floor']:.2f}x)"
