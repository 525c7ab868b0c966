"""The engine benchmark's decode floors on the model it runs (`benchmarks/roofline.py` has the
arithmetic): for a mixture-of-experts model, the experts the loop's own batch touches, counted
by its routers in one eager forward outside the timed loop."""

from __future__ import annotations

import torch

from benchmarks.decode_loop import LoopResult
from benchmarks.roofline import (
    expert_bytes,
    expert_layers,
    flop_seconds,
    routed_experts,
    routed_top_k,
    step_weight_bytes,
    uniform_touched,
)
from common.engine.scheduler import ScheduledBatch, ScheduledSeq
from common.engine.sequence import PLACEHOLDER, Sequence
from common.engine.worker import Worker


def experts_info(model: torch.nn.Module) -> dict | None:
    """The routed experts as the floors count them (None: a dense model)."""
    layers = expert_layers(model)
    if not layers:
        return None
    return {
        "moe_layers": len(layers),
        "num_experts": layers[0].num_experts,
        "top_k": routed_top_k(model)[0],
        "expert_bytes": expert_bytes(layers[0]),  # one expert of one layer
        "non_expert_bytes": step_weight_bytes(model, [0] * len(layers)),
    }


def touched_experts(worker: Worker, seqs: list[Sequence]) -> list[int]:
    """Per MoE layer, the distinct experts that one decode row of each of `seqs` routes to, by
    one eager forward outside the timed loop (a graph replay fires no hooks). Each row is its
    sequence's newest token already on the host (overlapped, the newest may be on the device
    still) at its position, within the blocks it holds: it rewrites that KV slot with what the
    real step writes there."""
    bs, items = worker.runner.block_size, []
    for seq in seqs:
        p = min(seq.num_tokens, len(seq.block_ids) * bs) - 1
        while seq.token_at(p) == PLACEHOLDER:
            p -= 1
        items.append(ScheduledSeq(seq, p, 1))
    runner = worker.runner
    inputs = runner.host_inputs(ScheduledBatch(items))
    with torch.inference_mode():
        return routed_experts(worker.model, lambda: runner._eager(inputs, None, None))


def decode_floors(
    worker: Worker, ceil: dict | None, r: LoopResult, touched: list[int] | None
) -> dict:
    """A decode step's floors: the weights it reads (MoE: every non-expert weight plus the
    experts of `touched`, measured, and of uniform routing) and the KV of every running
    request, at the copy rate; its matmuls at the matmul rate (`flop_floor_s`, for
    reference)."""
    model, spec = worker.model, worker.spec
    kv = (
        r.mean_running
        * r.mean_context
        * spec.kv_bytes_per_token(worker.kv_cache.pool.element_size())
    )
    uniform = uniform_touched(model, r.mean_running) if touched is not None else None
    row = {
        "floor_bytes": step_weight_bytes(model, touched) + kv,
        "touched_experts": touched,
        "touched_experts_uniform": None if uniform is None else sum(uniform) / len(uniform),
        "hbm_floor_s": None,
        "hbm_floor_uniform_s": None,
        "flop_floor_s": None,
    }
    if ceil is not None:
        copy = ceil["copy_bytes_per_s"]
        row["hbm_floor_s"] = row["floor_bytes"] / copy
        if uniform is not None:
            row["hbm_floor_uniform_s"] = (step_weight_bytes(model, uniform) + kv) / copy
        rows, pairs = r.mean_running, r.mean_running * r.mean_context
        row["flop_floor_s"] = flop_seconds(model, spec, rows, rows, pairs, ceil)
    return row
