"""The ceilings an engine benchmark measures in its own run (copy bandwidth, bf16 and FP8 matmul
rates) and the floors derived from them: a decode step reads the weights as stored (FP8
weights one byte, their float32 scales included) and the KV in the pool's dtype; a prefill step
runs the decoder's matmuls at the rate of their weights' dtype, the LM head (last token only)
and attention at the bf16 rate.

Mixture-of-experts models: a step reads every non-expert weight (attention, norms, routers,
shared experts, dense layers, LM head) but only the routed experts its tokens touch, per MoE
layer the distinct experts routed to times one expert's bytes (`step_weight_bytes`). The count
is either measured (`routed_experts`: the routers of one eager forward of the step's own
tokens) or the uniform-routing expectation E * (1 - (1 - k/E)^tokens) (`uniform_touched`).
FLOPs count the active parameters: each token runs top_k experts (`matmul_params`).

Attention FLOPs (`attention_flops`) per (query, key) pair, per query head and layer:
- K/V heads: 2 * head_dim for the score and 2 * head_dim for the weighted value;
- MLA, absorbed form (DeepSeek; our kernels run it for decode and prefill): the score reads the
  latent and the rotary key, 2 * (kv_lora_rank + qk_rope_head_dim), the output the latent
  again, 2 * kv_lora_rank. The absorption matmuls (W_UK into the query, W_UV after) are
  parameters of the model and counted with the matmuls.
The KV a step reads is `spec.kv_bytes_per_token` per token of context (MLA: the latent)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from common.model.layers.moe import Experts, Router
from common.model.spec import ModelSpec
from pdserve.planner.cost_model import expected_touched

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
    """(high-precision, FP8) weight elements a token runs through in the decoder's matmuls: 2-D
    parameters other than the embedding table and the LM head, and other than scales (float32
    block scales are 2-D too), plus top_k experts' of each MoE layer (stacked, 3-D)."""
    skip = {id(model.model.embed_tokens.weight), id(model.lm_head.weight)}
    high = fp8 = 0
    for name, p in model.named_parameters():
        if p.dim() != 2 or id(p) in skip or "scale" in name.rsplit(".", 1)[-1]:
            continue
        if p.dtype == FP8:
            fp8 += p.numel()
        else:
            high += p.numel()
    for experts, k in zip(expert_layers(model), routed_top_k(model), strict=True):
        for p in (experts.gate_up_proj, experts.down_proj):
            active = k * p[0].numel()
            if p.dtype == FP8:
                fp8 += active
            else:
                high += active
    return high, fp8


def expert_layers(model: nn.Module) -> list[Experts]:
    """The routed experts of every MoE layer, in layer order ([] for a dense model)."""
    return [m for m in model.modules() if isinstance(m, Experts)]


def routed_top_k(model: nn.Module) -> list[int]:
    return [m.moe.top_k for m in model.modules() if isinstance(m, Router)]


def expert_bytes(experts: Experts) -> int:
    """One expert's bytes in one layer (gate_up and down, any scales) as this rank holds it."""
    total = sum(p.numel() * p.element_size() for p in experts.parameters())
    return total // len(experts.expert_range)


def step_weight_bytes(model: nn.Module, touched: Sequence[float] | None) -> float:
    """Weight bytes a step reads when MoE layer i's tokens route to `touched[i]` distinct
    experts: `weight_bytes` less every routed expert, plus the touched ones. None (or a
    dense model with []): every weight."""
    layers = expert_layers(model)
    if touched is None:
        return float(weight_bytes(model))
    if len(touched) != len(layers):
        raise ValueError(f"touched experts for {len(touched)} layers, the model has {len(layers)}")
    stacked = sum(p.numel() * p.element_size() for e in layers for p in e.parameters())
    read = sum(n * expert_bytes(e) for n, e in zip(touched, layers, strict=True))
    return weight_bytes(model) - stacked + read


def uniform_touched(model: nn.Module, tokens: float) -> list[float]:
    """Per MoE layer, the distinct experts `tokens` tokens touch under uniform routing."""
    return [
        expected_touched(m.moe.num_experts, m.moe.top_k, tokens)
        for m in model.modules()
        if isinstance(m, Router)
    ]


def routed_experts(model: nn.Module, forward: Callable[[], object]) -> list[int]:
    """Per MoE layer, the distinct experts its router picks during `forward()`, which must run
    the model eagerly (forward hooks do not fire in a CUDA graph's replay)."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    seen: list[list[torch.Tensor]] = [[] for _ in routers]

    def hook(i: int) -> Callable:
        return lambda module, args, out: seen[i].append(out[1])  # out: (weights, ids)

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    try:
        forward()
    finally:
        for handle in handles:
            handle.remove()
    silent = [i for i, ids in enumerate(seen) if not ids]
    if silent:
        raise ValueError(f"routers of MoE layers {silent} did not run: was the forward eager?")
    return [int(torch.cat(ids).unique().numel()) for ids in seen]


def attention_flops(spec: ModelSpec, pairs: float) -> float:
    """FLOPs of `pairs` (query token, key) pairs over every head and layer (module docstring)."""
    if spec.mla is not None:
        per_head = 2 * (spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim)
        per_head += 2 * spec.mla.kv_lora_rank
    else:
        per_head = 4 * spec.head_dim
    return pairs * per_head * spec.num_heads * spec.num_layers


def flop_seconds(model: nn.Module, spec: ModelSpec, tokens: float, heads: float, pairs: float,
                 ceil: dict) -> float:  # fmt: skip
    """Seconds of a step's matmuls at the measured rates: `tokens` rows through the decoder
    (FP8 weights at the FP8 rate), `heads` rows through the LM head and `pairs` attention
    pairs at the bf16 rate."""
    high, fp8 = matmul_params(model)
    head = spec.vocab_size * spec.hidden_size
    bf16_flops = 2 * tokens * high + 2 * heads * head + attention_flops(spec, pairs)
    fp8_rate = ceil.get("fp8_flops_per_s")
    if fp8 and fp8_rate is None:
        raise ValueError(f"an FP8 model ({fp8} FP8 weights) but no FP8 matmul ceiling: {ceil}")
    seconds = bf16_flops / ceil["bf16_flops_per_s"]
    if fp8:
        seconds += 2 * tokens * fp8 / fp8_rate
    return seconds


def prefill_floors(model: nn.Module, spec: ModelSpec, tokens: int, ceil: dict) -> dict:
    """A one-prompt prefill of `tokens`: its FLOP floor (FP8 matmuls at the FP8 rate, the rest
    at the bf16 rate; the LM head for the last token only; T * T / 2 attention pairs), the
    weight-read floor (MoE: the experts `tokens` tokens touch under uniform routing), and
    which matmul ceiling its decoder uses."""
    _, fp8 = matmul_params(model)
    touched = uniform_touched(model, tokens) if expert_layers(model) else None
    return {
        "flop_floor_s": flop_seconds(model, spec, tokens, 1, tokens * tokens / 2, ceil),
        "weight_floor_s": step_weight_bytes(model, touched) / ceil["copy_bytes_per_s"],
        "matmul_ceiling": "fp8" if fp8 else "bf16",
    }
