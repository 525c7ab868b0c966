"""FP8 W8A8 GEMMs: out[m, n] = sum_k a[m, k] * b[n, k] * scales (+ bias), fp32 accumulation.

One kernel, two scale layouts (a constexpr):
- block (DeepSeek-V3): a's scales per token and `group_k` columns, [M, KB]; b's per output row
  and K block, [N, KB] (128 x 128 weight blocks expanded over rows by the caller). A K
  iteration covers one or two groups, each group's product scaled before it joins the
  accumulator.
- channel: a's scale per token ([M, 1], [M] or a scalar), b's per output row ([N] or a scalar),
  applied once to the finished accumulator.

Contracts: a [M, K] and b [N, K] are float8_e4m3fn with unit stride along K (b is the weight as
stored, row-major: each tile of b is K-major, the layout Hopper's FP8 MMA wants); M, N and K
need not be multiples of the tiles. Small M swaps the operands (b's rows fill the MMA's
64-row side instead of padding M to 64) and splits K over several programs when the output
tiles alone leave SMs idle; split partials go to a float32 workspace that `_epilogue_kernel`
sums in a fixed order (deterministic, no atomics). Tile configs come from tables on M, never
from autotuning, since CUDA graphs capture these launches.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from common.model.kernels import tma
from common.model.kernels.loads import load_k
from common.model.kernels.pdl import pdl_args, pdl_prologue

FP8 = torch.float8_e4m3fn
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GROUP_M = 8  # output tiles walked in groups of 8 row tiles, so neighbours share b in L2


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int  # K per loop iteration; block-scaled: rounded to 1 or 2 whole groups
    num_warps: int
    num_stages: int
    swap_ab: bool  # compute out.T tiles: b's rows on the MMA's M side (small M)
    split_k: int = 0  # 0: chosen by `split_k_for`
    # K columns summed in the tensor cores' reduced FP8 accumulator before each fp32 add:
    # Hopper keeps ~14 bits there, so whole-K accumulation drifts ~1% at K = 18944.
    promote_k: int = 128
    # b's tiles through a TMA descriptor instead of per-thread loads, where `tma.rows_fit`.
    tma: bool = False


# By M bucket (the key is its largest M), from benchmarks/bench_fp8_linear.py --sweep on one
# H200 over the Qwen2.5-7B and Qwen3-8B linears (graph-replayed GEMM time). Weights through
# TMA where `--tma-sweep` (2026-11-26, both models, every linear of a step) measured it
# faster and the decode node loop agreed: per channel 1-2% at M = 32 (the loop at batch 32: 3%),
# block-scaled 4-6% at M <= 2 and 14% at 32 (the loop at batch 1 and 32: 4% and 8%). At M = 1
# per channel (1.5-2% here, 1.7% slower in the loop) and block-scaled at 64 (9-10% here, no
# change in the loop) TMA is not taken; elsewhere it moved a step by less than 1%.
CHANNEL_CONFIGS: tuple[tuple[int, TileConfig], ...] = (
    (16, TileConfig(16, 64, 256, 4, 4, True)),
    (32, TileConfig(32, 64, 256, 4, 4, True, tma=True)),
    (64, TileConfig(64, 64, 128, 4, 4, True)),
    (128, TileConfig(64, 64, 128, 4, 4, False)),
    (512, TileConfig(64, 128, 128, 4, 3, False)),
    (1 << 62, TileConfig(128, 128, 128, 4, 3, False)),
)
# Block-scaled: each group's product is scaled before it joins the accumulator, so the MMAs
# cannot chain; beyond M = 64 cuBLASLt's block-scaled GEMM is about 2x faster where it applies
# (`fp8_gemm.block_fp8_linear_cuda`), and these tiles are the fallback.
# At M = 1 (`bench_fp8_linear.py --sweep`, Qwen3-8B's linears on an H200): 128 weight rows a
# program on the MMA's M side, 3.10 ms a step against 3.28 for the M <= 16 tiles (which win
# at M = 8: 2.88 against 3.02); the decode node loop at batch 1, 4.58 against 4.76 ms.
BLOCK_CONFIGS: tuple[tuple[int, TileConfig], ...] = (
    (2, TileConfig(16, 128, 256, 4, 3, True, tma=True)),
    (16, TileConfig(16, 64, 256, 4, 4, False)),
    (32, TileConfig(32, 64, 256, 4, 4, True, tma=True)),
    (64, TileConfig(64, 64, 128, 4, 4, True)),
    (1 << 62, TileConfig(64, 128, 128, 4, 3, False)),
)
MAX_SPLIT_K = 16


def pick_config(m: int, block_scaled: bool) -> TileConfig:
    table = BLOCK_CONFIGS if block_scaled else CHANNEL_CONFIGS
    return next(config for top, config in table if m <= top)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H200's, so CPU runs take the splits the GPU takes
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k_for(m: int, n: int, k: int, config: TileConfig, sms: int) -> int:
    """Enough splits to give each SM an output tile, while each split keeps >= 4 K tiles and
    the fp32 partials (written and read back once) stay under ~1/8 of b's bytes."""
    if config.split_k:
        return config.split_k
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    k_tiles = triton.cdiv(k, config.block_k)
    want = triton.cdiv(sms, tiles)
    cap = min(MAX_SPLIT_K, k_tiles // 4, k // (64 * m))
    return max(1, min(want, cap))


@triton.jit
def _load_b(b_rows, b_desc, b_row, k0, rk, K, EVEN_K: tl.constexpr, TMA: tl.constexpr):
    """b's [BLOCK_N, BLOCK_K] tile at columns k0 + rk: through the descriptor (rows from
    `b_row`; TMA fills zeros past N and K) or per-thread loads of `b_rows`."""
    if TMA:
        tile = b_desc.load([b_row, k0])
    else:
        tile = load_k(b_rows, k0 + rk, K, EVEN_K)
    return tile


@triton.jit
def _group_dot(a_rows, b_rows, b_desc, b_row, k0, rk, K, EVEN_K: tl.constexpr,
               SWAP_AB: tl.constexpr, PROMOTE_K, TMA: tl.constexpr):  # fmt: skip
    """A fresh fp32 product of one K group: [BLOCK_M, BLOCK_N], or its transpose if SWAP_AB."""
    a = load_k(a_rows, k0 + rk, K, EVEN_K)
    b = _load_b(b_rows, b_desc, b_row, k0, rk, K, EVEN_K, TMA)
    # One return: Triton checks every return's type, constexpr branches included.
    if SWAP_AB:
        product = tl.dot(b, tl.trans(a), max_num_imprecise_acc=PROMOTE_K)
    else:
        product = tl.dot(a, tl.trans(b), max_num_imprecise_acc=PROMOTE_K)
    return product


@triton.jit
def _group_scales(a_scale_ptr, b_scale_ptr, rm, rn, kg, kb, stride_sam, stride_sak,
                  stride_sbn, stride_sbk, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr):  # fmt: skip
    """sa[m, kg] * sb[n, kg] in the accumulator's orientation. A group past the end of K (the
    second of an odd count) reads the last group's scales: its product is all zeros."""
    if not EVEN_K:
        kg = tl.minimum(kg, kb - 1)
    sa = tl.load(a_scale_ptr + rm * stride_sam + kg * stride_sak)
    sb = tl.load(b_scale_ptr + rn * stride_sbn + kg * stride_sbk)
    if SWAP_AB:
        scale = sb[:, None] * sa[None, :]
    else:
        scale = sa[:, None] * sb[None, :]
    return scale


@triton.jit
def _w8a8_kernel(
    a_ptr, b_ptr, b_desc, a_scale_ptr, b_scale_ptr, bias_ptr, out_ptr,
    M, N, K, k_iters_per_split,
    stride_am, stride_bn, stride_sam, stride_sak, stride_sbn, stride_sbk, stride_os, stride_om,
    BLOCK_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr,
    EVEN_K: tl.constexpr, GROUP_M: tl.constexpr, GROUPS: tl.constexpr, PROMOTE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TMA: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (tile, split): K iterations [split * per, (split + 1) * per) of one output tile,
    each GROUPS * BLOCK_K columns (block-scaled: GROUPS scale groups of BLOCK_K, their products
    issued before either is scaled, so the MMAs overlap). With one split `out` is the result
    (scaled, bias added, cast); else a float32 [S, M, N] workspace of scaled partials, bias
    left to the epilogue. PROMOTE_K: K columns the tensor cores accumulate in their reduced
    FP8 precision before the sum joins the fp32 accumulator (DeepSeek-V3's promotion). TMA:
    b's tiles come through `b_desc` (b itself, unread, stands in without it)."""
    pdl_prologue(PDL)
    pid, split = tl.program_id(0), tl.program_id(1)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past M or N load row 0 instead (no mask on the hot loads); the store drops them.
    rm_in = tl.where(rm < M, rm, 0)
    rn_in = tl.where(rn < N, rn, 0)
    rk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rm_in.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + rn_in.to(tl.int64)[:, None] * stride_bn
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kb = tl.cdiv(K, BLOCK_K)
    k_lo = split * k_iters_per_split
    k_hi = tl.minimum(k_lo + k_iters_per_split, tl.cdiv(K, GROUPS * BLOCK_K))
    b_row = pid_n * BLOCK_N  # the tile's first row, where TMA reads
    for it in range(k_lo, k_hi):
        kg = it * GROUPS
        if BLOCK_SCALED:
            p0 = _group_dot(
                a_rows, b_rows, b_desc, b_row, kg * BLOCK_K, rk, K, EVEN_K, SWAP_AB, PROMOTE_K, TMA
            )
            if GROUPS == 2:
                p1 = _group_dot(
                    a_rows, b_rows, b_desc, b_row, (kg + 1) * BLOCK_K, rk, K,
                    EVEN_K, SWAP_AB, PROMOTE_K, TMA,
                )  # fmt: skip
            acc += p0 * _group_scales(
                a_scale_ptr, b_scale_ptr, rm_in, rn_in, kg, kb,
                stride_sam, stride_sak, stride_sbn, stride_sbk, EVEN_K, SWAP_AB,
            )  # fmt: skip
            if GROUPS == 2:
                acc += p1 * _group_scales(
                    a_scale_ptr, b_scale_ptr, rm_in, rn_in, kg + 1, kb,
                    stride_sam, stride_sak, stride_sbn, stride_sbk, EVEN_K, SWAP_AB,
                )  # fmt: skip
        else:
            a = load_k(a_rows, kg * BLOCK_K + rk, K, EVEN_K)
            b = _load_b(b_rows, b_desc, b_row, kg * BLOCK_K, rk, K, EVEN_K, TMA)
            if SWAP_AB:
                acc = tl.dot(b, tl.trans(a), acc, max_num_imprecise_acc=PROMOTE_K)
            else:
                acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=PROMOTE_K)
    if not BLOCK_SCALED:
        sa = tl.load(a_scale_ptr + rm_in * stride_sam)
        sb = tl.load(b_scale_ptr + rn_in * stride_sbn)
        if SWAP_AB:
            acc = acc * (sb[:, None] * sa[None, :])
        else:
            acc = acc * (sa[:, None] * sb[None, :])
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn_in).to(tl.float32)
        if SWAP_AB:
            acc += bias[:, None]
        else:
            acc += bias[None, :]
    out = out_ptr + split.to(tl.int64) * stride_os
    if SWAP_AB:
        offs = rm.to(tl.int64)[None, :] * stride_om + rn[:, None]
        mask = (rm[None, :] < M) & (rn[:, None] < N)
    else:
        offs = rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _epilogue_kernel(
    src_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, out_ptr,
    M, N, stride_ss, stride_sm, stride_sam, stride_sbn, stride_om,
    SPLITS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """out = (sum of SPLITS partials [S, M, N], in order) * sa[m] * sb[n] + bias[n]."""
    pdl_prologue(PDL)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    src = src_ptr + rm.to(tl.int64)[:, None] * stride_sm + rn[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(src + s * stride_ss, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        sa = tl.load(a_scale_ptr + rm * stride_sam, mask=rm < M, other=0.0)
        sb = tl.load(b_scale_ptr + rn * stride_sbn, mask=rn < N, other=0.0)
        acc = acc * (sa[:, None] * sb[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def w8a8_block_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_k: int,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """a [M, K] FP8 with a_scale [M, KB] float32; b [N, K] FP8 with b_scale [N, KB] float32,
    KB = ceil(K / group_k); group_k a power of two >= 16 (the K tile). Returns [M, N]."""
    m, k, n = _check_operands(a, b, out_dtype, bias)
    if group_k < 16 or group_k & (group_k - 1):
        raise ValueError(f"group_k must be a power of two >= 16, got {group_k}")
    kb = triton.cdiv(k, group_k)
    if a_scale.shape != (m, kb) or b_scale.shape != (n, kb):
        raise ValueError(
            f"block scales must be a [{m}, {kb}] and b [{n}, {kb}] for K={k}, "
            f"group_k={group_k}; got {tuple(a_scale.shape)} and {tuple(b_scale.shape)}"
        )
    _check_scale_dtypes(a_scale, b_scale)
    config = config or pick_config(m, block_scaled=True)
    groups = 2 if config.block_k >= 2 * group_k else 1
    config = dataclasses.replace(config, block_k=groups * group_k)
    scales = (a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1))
    return _launch(a, a_scale, b, b_scale, scales, groups, out_dtype, bias, config)


def w8a8_channel_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """a [M, K] FP8 with a_scale float32 [M, 1], [M] or a scalar; b [N, K] FP8 with b_scale
    float32 [N] or a scalar. Returns [M, N]."""
    m, k, n = _check_operands(a, b, out_dtype, bias)
    a_stride, b_stride = (
        _vector_scale_stride(a_scale, m, "a"),
        _vector_scale_stride(b_scale, n, "b"),
    )
    _check_scale_dtypes(a_scale, b_scale)
    scales = (a_stride, 0, b_stride, 0)
    config = config or pick_config(m, block_scaled=False)
    return _launch(a, a_scale, b, b_scale, scales, 0, out_dtype, bias, config)


def scale_epilogue(
    acc: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """acc [M, N] (any float dtype, unit stride along N) * a_scale[m] * b_scale[n] + bias[n],
    as `out_dtype`: the scales of an unscaled FP8 product, in one pass."""
    m, n = acc.shape
    a_stride, b_stride = (
        _vector_scale_stride(a_scale, m, "a"),
        _vector_scale_stride(b_scale, n, "b"),
    )
    if acc.stride(1) != 1:
        acc = acc.contiguous()
    out = torch.empty(m, n, dtype=out_dtype, device=acc.device)
    scales = (a_scale, b_scale, a_stride, b_stride)
    _run_epilogue(acc.unsqueeze(0), scales, bias, out)
    return out


def _check_operands(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> tuple[int, int, int]:
    if a.dtype != FP8 or b.dtype != FP8 or a.dim() != 2 or b.dim() != 2:
        raise ValueError(
            f"operands must be 2-D {FP8}, got a {a.dtype} {tuple(a.shape)}, "
            f"b {b.dtype} {tuple(b.shape)}"
        )
    (m, k), n = a.shape, b.shape[0]
    if b.shape[1] != k:
        raise ValueError(f"a [M, K] = {tuple(a.shape)} and b [N, K] = {tuple(b.shape)} differ in K")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    return m, k, n


def _check_scale_dtypes(a_scale: torch.Tensor, b_scale: torch.Tensor) -> None:
    if a_scale.dtype != torch.float32 or b_scale.dtype != torch.float32:
        raise ValueError(f"scales must be float32, got {a_scale.dtype} and {b_scale.dtype}")


def _vector_scale_stride(scale: torch.Tensor, size: int, name: str) -> int:
    """The element stride of a per-row scale (0 for a scalar: every row reads element 0)."""
    if scale.numel() == 1:
        return 0
    if scale.numel() != size or scale.dim() > 2:
        raise ValueError(
            f"{name}_scale must be a scalar or hold one value per row ({size}), "
            f"got {tuple(scale.shape)}"
        )
    return scale.stride(0)


def _launch(a, a_scale, b, b_scale, scale_strides, groups, out_dtype, bias, config):
    """Runs the GEMM kernel with one split (out written directly) or several (partials, then
    the epilogue sums them and adds the bias). `groups`: scale groups per K iteration of a
    block-scaled launch (config.block_k spans them), 0 for per-channel scales."""
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(1) != 1:
        b = b.contiguous()
    (m, k), n = a.shape, b.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    splits = split_k_for(m, n, k, config, _sm_count(a.device))
    k_iters = triton.cdiv(k, config.block_k)
    per_split = triton.cdiv(k_iters, splits)
    splits = triton.cdiv(k_iters, per_split)  # no split left without K iterations
    target = out if splits == 1 else torch.empty(splits, m, n, device=a.device)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    block_k = config.block_k // max(groups, 1)  # one dot's K
    through_tma = config.tma and tma.rows_fit(b)
    b_desc = tma.tiles(b, [config.block_n, block_k]) if through_tma else b
    _w8a8_kernel[(tiles, splits)](
        a, b, b_desc, a_scale, b_scale, bias if bias is not None and splits == 1 else out, target,
        m, n, k, per_split,
        a.stride(0), b.stride(0), *scale_strides, m * n, n,
        BLOCK_SCALED=groups > 0, HAS_BIAS=bias is not None and splits == 1,
        SWAP_AB=config.swap_ab, EVEN_K=k % config.block_k == 0, GROUP_M=GROUP_M,
        GROUPS=max(groups, 1), PROMOTE_K=min(config.promote_k, block_k),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, TMA=through_tma,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_args(a.device),
    )  # fmt: skip
    if splits > 1:
        _run_epilogue(target, None, bias, out)
    return out


def _run_epilogue(src, scales, bias, out) -> None:
    """src [S, M, N] (unit stride along N) -> out [M, N]; `scales` is (a_scale, b_scale,
    a_stride, b_stride) or None."""
    splits, m, n = src.shape
    block_m, block_n = 16, 256
    a_scale, b_scale, a_stride, b_stride = scales if scales is not None else (out, out, 0, 0)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _epilogue_kernel[grid](
        src, a_scale, b_scale, bias if bias is not None else out, out,
        m, n, src.stride(0), src.stride(1), a_stride, b_stride, out.stride(0),
        SPLITS=splits, HAS_SCALE=scales is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, **pdl_args(out.device),
    )  # fmt: skip
