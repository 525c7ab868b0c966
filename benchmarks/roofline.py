"""The ceilings an engine benchmark measures in its own run (copy bandwidth, bf16 and FP8 matmul
rates) and the floors derived from them: a decode step reads the weights as stored (FP8
weights one byte, their float32 scales included) and the KV in the pool's dtype; a prefill step
runs the decoder's matmuls at the rate of their weights' dtype, the LM head (last token only)
and attention at the bf16 rate."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
MATMUL_N = 8192  # the ceilings' square matmul


def time_fn(fn: Callable[[], object], repeats: int, cuda: bool, warmup: int = 2) -> float:
    """Median seconds of `fn()` (CUDA events on a GPU, the host clock elsewhere)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def measure_ceilings() -> dict[str, float | None] | None:
    """Copy bandwidth (bytes read + written per second), the bf16 matmul rate and, where the
    GPU has FP8 tensor cores (compute capability 8.9+), the per-tensor-scaled e4m3 rate of
    `torch._scaled_mm`; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    ceilings = {"copy_bytes_per_s": _copy_rate(), **_matmul_rates()}
    torch.cuda.empty_cache()
    return ceilings


def _copy_rate() -> float:
    n = 1 << 30  # 2 GiB of bf16 per buffer
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * n * 2 / time_fn(lambda: dst.copy_(src), 20, True)


def _matmul_rates() -> dict[str, float | None]:
    a = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device="cuda")
    flops = 2 * MATMUL_N**3
    rates: dict[str, float | None] = {"bf16_flops_per_s": flops / time_fn(lambda: a @ b, 20, True)}
    rates["fp8_flops_per_s"] = None
    if torch.cuda.get_device_capability() >= (8, 9):
        qa, qb, one = a.to(FP8), b.to(FP8), torch.ones((), device="cuda")

        def scaled_mm() -> torch.Tensor:
            # _scaled_mm wants its second operand column-major: qb.t() of a row-major qb is.
            return torch._scaled_mm(qa, qb.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        rates["fp8_flops_per_s"] = flops / time_fn(scaled_mm, 20, True)
    return rates


def weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads of the weights: every parameter at its element size (FP8
    weights one byte, their float32 scales four), less the embedding table unless the LM head
    shares it (a lookup reads rows, not the table)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    if embed is not model.lm_head.weight:
        total -= embed.numel() * embed.element_size()
    return total


def matmul_params(model: nn.Module) -> tuple[int, int]:
    """(high-precision, FP8) weight elements of the decoder's matmuls: 2-D parameters other
    than the embedding table and the LM head, and other than scales (float32 block scales are
    2-D too)."""
    skip = {id(model.model.embed_tokens.weight), id(model.lm_head.weight)}
    high = fp8 = 0
    for name, p in model.named_parameters():
        if p.dim() != 2 or id(p) in skip or "scale" in name.rsplit(".", 1)[-1]:
            continue
        if p.dtype == FP8:
            fp8 += p.numel()
        else:
            high += p.numel()
    return high, fp8


def prefill_floors(model: nn.Module, spec, tokens: int, ceil: dict) -> dict:
    """A one-prompt prefill of `tokens`: its FLOP floor (FP8 matmuls at the FP8 rate, the rest
    at the bf16 rate), the weight-read floor, and which matmul ceiling its decoder uses."""
    high, fp8 = matmul_params(model)
    head = spec.vocab_size * spec.hidden_size  # the LM head runs for the last token only
    attention = 2 * tokens * tokens * spec.head_dim * spec.num_heads * spec.num_layers
    bf16_flops = 2 * tokens * high + 2 * head + attention
    fp8_rate = ceil.get("fp8_flops_per_s")
    if fp8 and fp8_rate is None:
        raise ValueError(f"an FP8 model ({fp8} FP8 weights) but no FP8 matmul ceiling: {ceil}")
    flop_floor = bf16_flops / ceil["bf16_flops_per_s"]
    if fp8:
        flop_floor += 2 * tokens * fp8 / fp8_rate
    return {
        "flop_floor_s": flop_floor,
        "weight_floor_s": weight_bytes(model) / ceil["copy_bytes_per_s"],
        "matmul_ceiling": "fp8" if fp8 else "bf16",
    }
