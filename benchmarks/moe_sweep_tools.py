"""What the expert-tile sweeps share (`sweep_moe_fp8.py`, `sweep_moe_tma.py`): Qwen3-30B-A3B-shaped
expert weights in rotated copies, bf16 and FP8, and the time of one call as a CUDA graph that
runs it once on each copy (so no call finds its experts in L2)."""

import statistics

import torch

from common.model.quantization import fp8_ops
from common.model.quantization.fp8_experts import ExpertScales


def quantize(w: torch.Tensor, group: tuple[int, int] | None):
    """[E, N, K] weights -> FP8 and their scales: per `group` block, or per row (None)."""
    pairs = [
        fp8_ops.quantize_weight_blocks(one, group) if group else fp8_ops.quantize_per_token(one)
        for one in w.float()
    ]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def expert_copies(copies: int, experts: int, hidden: int, inter: int, device: str = "cuda"):
    """(bf16 [(w13, w2)] per copy, {"block": [(q13, q2, scales)], "row": [...]}) of random
    experts (N(0, 1 / fan_in)); FP8 in 128 x 128 blocks and per row."""
    bf, fp = [], {"block": [], "row": []}
    for _ in range(copies):
        w13 = (torch.randn(experts, 2 * inter, hidden, device=device) * hidden**-0.5).bfloat16()
        w2 = (torch.randn(experts, hidden, inter, device=device) * inter**-0.5).bfloat16()
        bf.append((w13, w2))
        for name, group in (("block", (128, 128)), ("row", None)):
            q13, s13 = quantize(w13, group)
            q2, s2 = quantize(w2, group)
            gn, gk = group or (1, 0)
            fp[name].append((q13, q2, ExpertScales(s13, s2, gn, gk)))
    return bf, fp


def graph_time_us(fn, copies: int, reps: int = 10, trials: int = 1) -> float:
    """us per call of `fn(copy)`: a graph of one call per copy, replayed `reps` times, the
    median of `trials` such timings."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in range(copies):
            fn(c)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(trials):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps / copies)
    return statistics.median(times)
