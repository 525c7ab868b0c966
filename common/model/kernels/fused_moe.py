"""The expert computation of a mixture-of-experts layer, given the routing:

    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = topk_ids[t, j]

Weights (the MoE layer's contract): `w13` [E, 2I, H] (each expert's gate_proj rows, then its
up_proj rows), `w2` [E, H, I] (down_proj), in x's dtype; or FP8 with their `ExpertScales`
(`common.model.quantization.fp8_experts`): the experts then compute W8A8 (x and the SiLU-and-mul
output quantized to FP8, the FP8 tensor cores or, in the GEMVs, float32 products of FP8 values,
each K block's sum scaled). Routing: `topk_weights` [T, k]
float32 (already normalized / scaled), `topk_ids` [T, k] int32 or int64; an id outside [0, E)
drops its pair (expert parallelism's non-local experts). Output [T, H] in x's dtype.

Implementations (`experts_forward` dispatches):
- `fused_moe_triton`: a plan (`moe_align`), GEMM1 (x rows gathered by the plan, times the
  expert's gate and up tiles, SiLU(gate) * up in the epilogue), GEMM2 (times w2[e], the routing
  weight in the epilogue), then each token's k rows summed in slot order by one kernel:
  deterministic, no atomics. 4 launches up to `ONE_PROGRAM_PAIRS` pairs, 5 beyond. Up to
  `GEMV_MAX_TOKENS` tokens (a `GemvConfig`): `fused_moe_gemv`'s two GEMV launches instead.
- `fused_moe_grouped_mm`: the plan with block_m = 1, x rows gathered, `torch._grouped_mm`,
  SiLU-and-mul, `torch._grouped_mm`, the weighted sum. 16-bit weights only; on CUDA bf16 only
  (sm90 / sm100 CUTLASS; other dtypes take torch's fallback, which syncs on `offs`); on CPU any
  float dtype.
- `moe_reference`: a torch loop over experts in float32; the CPU path and the tests' oracle.

Both GPU paths keep every shape static in T (no host sync), so CUDA graphs capture them.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
import triton

from common.model import ops
from common.model.kernels import fused_ops, tma
from common.model.kernels.fused_moe_gemv import (
    GEMV_CONFIG,
    GemvConfig,
    GemvTiles,
    fused_moe_gemv,
    fused_moe_gemv_fp8,
    narrowed,
)
from common.model.kernels.fused_moe_kernels import (
    act_scale_strides,
    down_kernel,
    gate_up_kernel,
    gather_rows_kernel,
    promote_k,
    sum_slots_kernel,
    weight_scale_strides,
)
from common.model.kernels.moe_align import ONE_PROGRAM_PAIRS, MoEPlan, moe_align
from common.model.kernels.pdl import pdl_args
from common.model.layers.moe_routing import pairs_by_expert
from common.model.quantization import fp8_experts
from common.model.quantization.fp8_experts import ExpertScales

__all__ = [
    "AUTO_IMPL",
    "FP8_PREFILL_CONFIGS",
    "GEMV_MAX_TOKENS",
    "IMPLS",
    "MOE_CONFIGS",
    "ONE_PROGRAM_PAIRS",
    "ExpertScales",
    "GemmTiles",
    "GemvConfig",
    "GemvTiles",
    "MoEConfig",
    "MoEPlan",
    "experts_forward",
    "fused_moe_grouped_mm",
    "fused_moe_triton",
    "moe_align",
    "moe_reference",
    "pick_config",
]


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    block_n: int  # GEMM1: columns of gate (and as many of up) per program; GEMM2: of out
    block_k: int
    num_warps: int
    num_stages: int
    # The expert weights' tiles (and in the down GEMM a whole block's rows of h) come through
    # TMA descriptors, not per-thread loads (CUDA from Hopper on, and the interpreter).
    tma: bool = False


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    block_m: int  # rows per program, and the plan's padding unit; >= 16 (tl.dot)
    gate_up: GemmTiles
    down: GemmTiles
    group_m: int = 8  # row blocks walked together, so neighbours share an expert tile in L2
    fill_sms: bool = True  # halve block_n (to 16) while the programs leave SMs idle
    # A block holding at most tail_m pairs (an expert's last, mostly padding) multiplies only
    # its first tail_m rows; 0: every block multiplies all block_m rows.
    tail_m: int = 0


# By the mean rows per expert, T * k / E (the key is its largest value): the best of
# `bench_moe.py --sweep` on one H200 (2026-11-24; Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V2-Lite
# layers, bf16). Decode: 16-row blocks and N tiles narrowed to spread one expert's weights over
# many SMs; prefill: 128-row blocks, deep K tiles, and an expert's last block, when it holds
# at most 64 (32) pairs, multiplies only 64 (32) rows: with near-even routing at 2048 tokens
# (Qwen3-30B-A3B: 128 pairs an expert) about half the experts have a second block holding a
# few pairs. `sweep_moe_fp8.py tail` (bf16 rows), us a layer: 2048 tokens 560 -> 497, 4096
# 823 -> 754, 8192 1388 -> 1316. The FP8 prefill tiles (64 rows) keep none: per-row scales
# lost 2-7% with it, block scales gained 1-6% (not yet timed in the engine). Up to 128 rows
# an expert the weights (and the down GEMM's h) come through TMA, 4 tiles deep:
# `sweep_moe_tma.py` (2026-11-26), 2048 tokens 506 -> 479 us; at 4096 and 8192 tokens neither
# TMA nor the depth moved the layer by more than the calls' 2-4% noise.
MOE_CONFIGS: tuple[tuple[float, MoEConfig], ...] = (
    (0.5, MoEConfig(16, GemmTiles(64, 256, 4, 3), GemmTiles(64, 256, 4, 3))),
    (16, MoEConfig(16, GemmTiles(128, 128, 4, 3), GemmTiles(128, 128, 4, 3))),
    (64, MoEConfig(64, GemmTiles(128, 64, 8, 4), GemmTiles(128, 64, 8, 4))),
    (
        128,
        MoEConfig(
            128, GemmTiles(128, 64, 8, 4, tma=True), GemmTiles(256, 64, 8, 4, tma=True), tail_m=64
        ),
    ),
    (float("inf"), MoEConfig(128, GemmTiles(128, 64, 8, 3), GemmTiles(256, 64, 8, 3), tail_m=64)),
)
# FP8 experts beyond 64 rows per expert, by scale layout (block, per row): the bf16 prefill tiles
# spill there (FP8 block at 2048 tokens: 2154 us against 560 for bf16), since each K block's
# product is a fresh accumulator. The best of a sweep on one H200 (Qwen3-30B-A3B, 2048 tokens,
# one layer, graph-replayed over rotated weights; sweep_moe_fp8 in docs/benchmarks.md): 535 and
# 441 us. Up to 64 rows per expert MOE_CONFIGS was within 2% of the sweep's best. Through TMA,
# 4 tiles deep (`sweep_moe_tma.py`, 2026-11-26, 2048 tokens): 524 -> 496 and 420 -> 396 us.
FP8_PREFILL_CONFIGS = {
    True: MoEConfig(64, GemmTiles(64, 128, 4, 4, tma=True), GemmTiles(64, 128, 4, 4, tma=True)),
    False: MoEConfig(64, GemmTiles(128, 128, 4, 4, tma=True), GemmTiles(128, 128, 4, 4, tma=True)),
}
# Up to this many tokens the experts run as GEMVs (`GEMV_CONFIG`): each pair reads its expert's
# weights itself, which costs nothing while the pairs of a step rarely share an expert.
GEMV_MAX_TOKENS = 4
# "auto" on CUDA: triton, but cuBLAS's grouped GEMM once experts are big and full: in that run
# it beat the best triton tiles only on Mixtral (intermediate 14336) from 512 rows per expert
# (2731 against 2958 us at 2048 tokens); triton led everywhere else, by x1.5-1.9 at decode sizes.
AUTO_IMPL: tuple[tuple[float, str], ...] = ((512, "triton"), (float("inf"), "grouped_mm"))
GROUPED_MM_MIN_INTERMEDIATE = 8192
IMPLS = ("auto", "triton", "grouped_mm", "reference")


def pick_config(
    num_tokens: int,
    top_k: int,
    w13: torch.Tensor,
    sms: int = 132,
    scales: ExpertScales | None = None,
) -> MoEConfig | GemvConfig:
    """`GEMV_CONFIG` up to `GEMV_MAX_TOKENS` tokens, else the table's entry for T * k / E rows
    per expert (FP8 `scales` beyond 64: `FP8_PREFILL_CONFIGS`); with `fill_sms`, block_n halved
    while the programs (of the row blocks that hold pairs: at least one per touched expert)
    number fewer than `sms`."""
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    hidden = w13.shape[2]
    if num_tokens <= GEMV_MAX_TOKENS:
        return narrowed(GEMV_CONFIG, num_tokens * top_k, num_tokens, inter, hidden, sms)
    per_expert = num_tokens * top_k / num_experts
    config = next(c for top, c in MOE_CONFIGS if per_expert <= top)
    if scales is not None and per_expert > 64:
        config = FP8_PREFILL_CONFIGS[bool(scales.group_k)]
    if not config.fill_sms:
        return config
    pairs = num_tokens * top_k
    blocks = max(triton.cdiv(pairs, config.block_m), min(num_experts, pairs))
    return dataclasses.replace(
        config,
        gate_up=_narrowed(config.gate_up, blocks, inter, sms),
        down=_narrowed(config.down, blocks, hidden, sms),
    )


def _narrowed(tiles: GemmTiles, blocks: int, n: int, sms: int) -> GemmTiles:
    block_n = tiles.block_n
    while block_n > 16 and blocks * triton.cdiv(n, block_n) < sms:
        block_n //= 2
    return dataclasses.replace(tiles, block_n=block_n)


def experts_forward(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    impl: str = "auto",
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """`out` [T, H] by `impl`: "auto" (the reference on CPU; on CUDA `AUTO_IMPL` by rows per
    expert, triton for small experts, FP8 ones, or where grouped_mm cannot run), "triton",
    "grouped_mm" or "reference"."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = _auto_impl(x, w13, topk_ids.shape[1], scales)
    if impl == "reference":
        return moe_reference(x, w13, w2, topk_weights, topk_ids, scales)
    if impl == "grouped_mm":
        if scales is not None:
            raise ValueError("grouped_mm multiplies 16-bit experts only, got FP8 ones")
        return fused_moe_grouped_mm(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, scales=scales)


def _auto_impl(x: torch.Tensor, w13: torch.Tensor, top_k: int, scales: ExpertScales | None) -> str:
    if x.device.type != "cuda":
        return "reference"
    if scales is not None:
        return "triton"
    per_expert = x.shape[0] * top_k / w13.shape[0]
    impl = next(name for top, name in AUTO_IMPL if per_expert < top)
    small = w13.shape[1] // 2 < GROUPED_MM_MIN_INTERMEDIATE
    if impl == "grouped_mm" and (x.dtype != torch.bfloat16 or small):
        return "triton"
    return impl


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoEConfig | GemvConfig | None = None,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """`out` by the Triton grouped GEMMs (or GEMVs); `config` None picks `pick_config`'s.
    FP8 experts (`scales`): x is quantized first and h between the GEMMs (one launch each,
    `ops.quantize_fp8`), and the GEMMs' K tiles stay inside one scale block."""
    tokens, hidden, num_experts, inter, top_k = _check(x, w13, w2, topk_weights, topk_ids, scales)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    if config is None:
        config = pick_config(tokens, top_k, w13, _sm_count(x.device), scales)
    x = x if x.stride(1) == 1 else x.contiguous()
    fp8 = scales is not None
    if fp8:
        quant = scales.activation_quant
        xa = ops.quantize_fp8(x, quant)
        if isinstance(config, GemvConfig):
            quantize = functools.partial(ops.quantize_fp8, quant=quant)
            fused_moe_gemv_fp8(xa, w13, w2, scales, topk_weights, topk_ids, config, out, quantize)
            return out
        config = _within_scale_blocks(config, scales.group_k)
        a, a_scale, s13, s2 = xa.data, xa.scale, scales.w13, scales.w2
        scale_args = dict(FP8=True, SCALE_GN=scales.group_n, SCALE_GK=scales.group_k)
    elif isinstance(config, GemvConfig):
        fused_moe_gemv(x, w13, w2, topk_weights, topk_ids, config, out)
        return out
    else:  # the scale operands stand in, never read
        a, a_scale, s13, s2 = x, x, w13, w2
        scale_args = dict(FP8=False, SCALE_GN=1, SCALE_GK=0)
    if config.block_m < 16 or config.block_m & (config.block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {config.block_m}")
    tail = config.tail_m
    if tail and (tail < 16 or tail & (tail - 1) or tail >= config.block_m):
        raise ValueError(f"tail_m must be 0 or a power of two in [16, block_m), got {tail}")
    plan = moe_align(topk_ids, num_experts, config.block_m)
    h = torch.empty(plan.num_rows, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(plan.num_rows, hidden, dtype=x.dtype, device=x.device)
    common = dict(
        BLOCK_M=config.block_m, GROUP_M=config.group_m, TOP_K=top_k, TAIL_M=tail,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    blocks = plan.block_expert.shape[0]
    t1 = _tma_checked(config.gate_up, w13)
    gate_up_kernel[(blocks * triton.cdiv(inter, t1.block_n),)](
        a, w13, _weight_tiles(w13, t1), a_scale, s13, plan.sorted_pairs, plan.block_expert, h,
        plan.num_pairs, blocks, inter, hidden,
        a.stride(0), w13.stride(0), w13.stride(1), *act_scale_strides(a_scale),
        *weight_scale_strides(s13), h.stride(0),
        EVEN_K=hidden % t1.block_k == 0, BLOCK_N=t1.block_n, BLOCK_K=t1.block_k, TMA=t1.tma,
        PROMOTE=promote_k(t1.block_k), num_warps=t1.num_warps, num_stages=t1.num_stages,
        **common, **scale_args, **pdl_args(x.device),
    )  # fmt: skip
    h_scale = h
    if fp8:
        ha = ops.quantize_fp8(h, quant)
        h, h_scale = ha.data, ha.scale
    t2 = _tma_checked(config.down, w2)
    h_tiles = tma.tiles(h, [config.block_m, t2.block_k]) if t2.tma else h
    down_kernel[(blocks * triton.cdiv(hidden, t2.block_n),)](
        h, h_tiles, w2, _weight_tiles(w2, t2), h_scale, s2, plan.sorted_pairs, plan.block_expert,
        topk_weights.contiguous(), y, plan.num_pairs, blocks, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), *act_scale_strides(h_scale),
        *weight_scale_strides(s2), y.stride(0),
        EVEN_K=inter % t2.block_k == 0, BLOCK_N=t2.block_n, BLOCK_K=t2.block_k, TMA=t2.tma,
        PROMOTE=promote_k(t2.block_k), num_warps=t2.num_warps, num_stages=t2.num_stages,
        **common, **scale_args, **pdl_args(x.device),
    )  # fmt: skip
    _sum_slots(y, plan, None, out)
    return out


def _tma_checked(tiles: GemmTiles, w: torch.Tensor) -> GemmTiles:
    """`tiles`, without TMA where it cannot read `w` (and the h rows, as wide as w2's):
    `tma.rows_fit`."""
    if tiles.tma and not tma.rows_fit(w):
        return dataclasses.replace(tiles, tma=False)
    return tiles


def _weight_tiles(w: torch.Tensor, tiles: GemmTiles):
    """The TMA descriptor of `w` [E, N, K] seen as [E * N, K], in [block_n, block_k] tiles; `w`
    itself standing in (never read) without TMA. A tile running past an expert's N rows reads
    the next expert's (or zeros past the end): those columns are never stored."""
    if not tiles.tma:
        return w
    return tma.tiles(w.view(-1, w.shape[2]), [tiles.block_n, tiles.block_k])


def _within_scale_blocks(config: MoEConfig, group: int) -> MoEConfig:
    """`config` with every K tile inside one block of `group` columns (0: per-row scales,
    unchanged), so a tile reads one scale per row."""
    if not group:
        return config

    def fit(tiles):
        return tiles if group % tiles.block_k == 0 else dataclasses.replace(tiles, block_k=group)

    return dataclasses.replace(config, gate_up=fit(config.gate_up), down=fit(config.down))


def fused_moe_grouped_mm(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """`out` by two `torch._grouped_mm` over the rows sorted by expert (no padding)."""
    tokens, hidden, num_experts, inter, _ = _check(x, w13, w2, topk_weights, topk_ids)
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        raise ValueError(f"grouped_mm runs bf16 only on CUDA (other dtypes sync), got {x.dtype}")
    if (hidden * x.element_size()) % 16 or (inter * x.element_size()) % 16:
        raise ValueError(f"grouped_mm needs rows of 16-byte multiples, got H={hidden}, I={inter}")
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    plan = moe_align(topk_ids, num_experts, 1)
    rows = torch.empty(plan.num_rows, hidden, dtype=x.dtype, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    block = min(1024, triton.next_power_of_2(hidden))
    gather_rows_kernel[(plan.num_rows, triton.cdiv(hidden, block))](
        x, plan.sorted_pairs, rows, plan.num_pairs, hidden, x.stride(0), rows.stride(0),
        TOP_K=plan.top_k, BLOCK=block, **pdl_args(x.device),
    )  # fmt: skip
    # Rows past the last expert's end (dropped pairs) are left uncomputed; nothing reads them.
    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=plan.expert_ends)
    h = fused_ops.silu_and_mul(gate_up)  # gate_up's rows may be padded (CUDA): strided
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=plan.expert_ends)
    _sum_slots(y, plan, topk_weights.contiguous(), out)
    return out


def moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """`out` by a loop over the experts, everything in float32 (syncs: not capturable); FP8
    experts by `fp8_experts.reference`, the same loop on the dequantized operands."""
    _, hidden, num_experts, inter, _ = _check(x, w13, w2, topk_weights, topk_ids, scales)
    if scales is not None:
        return fp8_experts.reference(x, w13, w2, scales, topk_weights, topk_ids)
    acc = torch.zeros(x.shape[0], hidden, dtype=torch.float32, device=x.device)
    xf = x.float()
    for expert, tokens, slots in pairs_by_expert(topk_ids, num_experts):
        gate_up = xf[tokens] @ w13[expert].float().T
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = act @ w2[expert].float().T
        acc.index_add_(0, tokens, y * topk_weights[tokens, slots, None].float())
    return acc.to(x.dtype)


def _sum_slots(y: torch.Tensor, plan: MoEPlan, weights: torch.Tensor | None, out) -> None:
    """out[t] = sum over slots j, in order, of y[pair_rows[t * k + j]] (times the routing
    weight if `weights`), float32 accumulation; dropped pairs (-1) add nothing."""
    tokens, hidden = out.shape
    block = min(1024, triton.next_power_of_2(hidden))
    sum_slots_kernel[(tokens, triton.cdiv(hidden, block))](
        y, plan.pair_rows, weights if weights is not None else y, out,
        hidden, y.stride(0), out.stride(0),
        TOP_K=plan.top_k, HAS_WEIGHTS=weights is not None, BLOCK=block, **pdl_args(out.device),
    )  # fmt: skip


def _check(x, w13, w2, topk_weights, topk_ids, scales=None) -> tuple[int, int, int, int, int]:
    """(T, H, E, I, k) of consistent operands, else a ValueError naming the shapes."""
    shapes = (
        f"x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
        f"topk_weights {tuple(topk_weights.shape)}, topk_ids {tuple(topk_ids.shape)}"
    )
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3 or topk_ids.dim() != 2:
        raise ValueError(f"want x [T, H], w13 [E, 2I, H], w2 [E, H, I], ids [T, k]; got {shapes}")
    (tokens, hidden), (num_experts, two_i, _) = x.shape, w13.shape
    inter = two_i // 2
    if (
        two_i % 2
        or w13.shape[2] != hidden
        or w2.shape != (num_experts, hidden, inter)
        or topk_ids.shape[0] != tokens
        or topk_weights.shape != topk_ids.shape
    ):
        raise ValueError(f"inconsistent MoE shapes: {shapes}")
    weight_dtype = x.dtype if scales is None else torch.float8_e4m3fn
    if w13.dtype != weight_dtype or w2.dtype != weight_dtype:
        raise ValueError(
            f"w13 and w2 must be {weight_dtype} (x {x.dtype}, FP8 scales given: "
            f"{scales is not None}), got {w13.dtype}, {w2.dtype}"
        )
    if scales is not None:
        _check_scales(scales, num_experts, 2 * inter, hidden, inter)
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError(
            f"topk_ids must be int32/int64 and topk_weights float, got {topk_ids.dtype}, "
            f"{topk_weights.dtype}"
        )
    if not w13.is_contiguous() or not w2.is_contiguous():
        raise ValueError("w13 and w2 must be contiguous")
    devices = {t.device for t in (x, w13, w2, topk_weights, topk_ids)}
    if len(devices) != 1:
        raise ValueError(f"operands on several devices: {sorted(map(str, devices))}")
    return tokens, hidden, num_experts, inter, topk_ids.shape[1]


def _check_scales(scales: ExpertScales, experts: int, rows: int, hidden: int, inter: int) -> None:
    def grid(n: int, k: int) -> tuple[int, int, int]:
        blocks = -(-k // scales.group_k) if scales.group_k else 1
        return experts, -(-n // scales.group_n), blocks

    want13, want2 = grid(rows, hidden), grid(hidden, inter)
    if tuple(scales.w13.shape) != want13 or tuple(scales.w2.shape) != want2:
        raise ValueError(
            f"FP8 expert scales must be w13 {want13} and w2 {want2} for groups "
            f"({scales.group_n}, {scales.group_k}), got {tuple(scales.w13.shape)} and "
            f"{tuple(scales.w2.shape)}"
        )
    if scales.w13.dtype != torch.float32 or scales.w2.dtype != torch.float32:
        raise ValueError(f"FP8 expert scales must be float32, got {scales.w13.dtype}")


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H200's, so CPU runs pick the configs the GPU picks
    return torch.cuda.get_device_properties(device).multi_processor_count
