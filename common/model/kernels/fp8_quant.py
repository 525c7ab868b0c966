"""FP8 activation quantization fused into the kernels that produce a linear layer's input:
RMSNorm (+ residual add), SiLU-and-mul, and a plain quantization (attention output -> o_proj).

RMSNorm: one program per token row. SiLU-and-mul and the plain quantization: per-token scales
at decode sizes split each row over many programs (chunk maxima first), and a prefill batch's
rows take one program per row holding all of it (`TOKEN_PATHS`, `default_token_path`); group
and static scales, one program per chunk. No host syncs (a static scale is read on the
device), so launches are capturable in CUDA graphs. Each kernel first
rounds its output to the model dtype exactly as `fused_ops` does, then quantizes as
`common.model.quantization.fp8_ops`: scale = max(amax * INV_FP8_MAX, MIN_SCALE),
q = e4m3(clamp(y / scale, ±448)), bit for bit, stored through a uint8 view. Compiled kernels
round to e4m3 in hardware (`cvt.rn.satfinite.e4m3x2.f32`: nearest, ties to even); Triton's CPU
interpreter rounds FP8 casts half-up, so there the same bits come from integer ops
(`_e4m3_bits`, 30-odd integer instructions an element). The tests check both against torch at
every tie, carry and subnormal. Inputs need only their last dimension contiguous.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from common.model.kernels.fused_ops import _row_warps
from common.model.kernels.pdl import pdl_args, pdl_prologue
from common.model.quantization.activation import ActivationQuant, Fp8Activation
from common.model.quantization.fp8_ops import FP8, FP8_MAX, INV_FP8_MAX, MIN_SCALE

_TOKEN, _GROUP = tl.constexpr(0), tl.constexpr(1)  # else static
_LAYOUT = {"token": 0, "group": 1, "static": 2}
_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_TOKEN_STEP = 8192  # columns per loop step of a per-token row program
_CHUNK = 1024  # columns per program of the group and static layouts
# Where a token row's amax comes from.
_PARTIALS, _RECOMPUTE = tl.constexpr(0), tl.constexpr(1)
# How per-token scales are computed (`quantize_fp8`'s `token_path`): "row", one program per
# row (two passes over it); "whole", one program per row holding all of it in up to three
# power-of-two blocks in the model dtype (`whole_pieces`: 18944 = 16384 + 2048 + 512; one
# pass: the row is read and, for SiLU-and-mul, computed once); "partials", chunk maxima from a
# first launch, then one program per chunk; "recompute", one launch, each chunk's program
# redoing the row's amax pass itself.
TOKEN_PATHS = ("row", "whole", "partials", "recompute")
WHOLE_MAX_COLUMNS = 32768  # a row held whole: 64 values a thread at 16 warps
# Prefill batches (more than SPLIT_MAX_ROWS rows) take "whole". On an H200 (CUDA graphs of one
# call, 2048 / 8192 rows; Qwen2.5-7B's and Qwen3-8B's inputs), against "partials": the
# down_proj input (SiLU-and-mul, 18944 wide) 79 / 302 us against 101 / 372, 12288 wide 45 / 157
# against 65 / 224; the o_proj input (3584 wide) 17 / 36 us against 21 / 58. Held as one
# float32 block padded to a power of two (32768 for 18944), the wide rows spilled registers:
# 151 / 572 us.
# Up to this many rows (decode batches) a row is spread over many programs: one program per
# row left an H200 at batch 1 with one SM quantizing an 18944-wide row (12.6 us a call, 0.70
# ms of a 4.0 ms Qwen2.5-7B step); at batch 128 the row path still took 12.4 us a call (1.4
# ms a step). Above it the rows alone fill the SMs, and each row goes whole.
SPLIT_MAX_ROWS = 256
_SPLIT_PROGRAMS = 1024  # chunks sized for several programs per SM of an H100 / H200
_SPLIT_MIN, _SPLIT_MAX = 256, 4096  # columns per chunk
_MAX = tl.constexpr(FP8_MAX)
_INV_MAX = tl.constexpr(INV_FP8_MAX)
_FLOOR = tl.constexpr(MIN_SCALE)
# Read when the kernels are decorated, as `triton.jit` reads TRITON_INTERPRET itself.
_HW_CAST = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def _e4m3_bits(v):
    """float32 -> float8_e4m3fn bits, round to nearest even, for finite |v| <= 448."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    exp = a >> 23
    # Normal (|v| >= 2^-6): keep 3 of 23 mantissa bits, ties to even; a carry bumps the
    # exponent. Rebias 127 -> 7: the float32 exponent field minus 120, shifted past 3 bits.
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal: |v| / 2^-9 rounded to an integer (8 is the smallest normal, same bits).
    shift = tl.minimum(141 - exp, 31)
    sig = (a & 0x7FFFFF) | 0x800000
    q = sig >> shift
    rem = sig - (q << shift)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    subnormal = q + up.to(tl.int32)
    return (sign | tl.where(exp >= 121, normal, subnormal)).to(tl.uint8)


@triton.jit
def _scale_of(amax):
    return tl.maximum(amax * _INV_MAX, _FLOOR)


# IEEE-rounded like torch's division by a tensor: Triton's `/` is div.full.f32 on NVIDIA.
@triton.jit
def _fp8(y, scale):
    v = tl.clamp(tl.math.div_rn(y, scale), -_MAX, _MAX)
    if _HW_CAST:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return _e4m3_bits(v)


@triton.jit
def _store_quantized(y, offs, n, q_row, s_row, stride_sg, static_ptr,
                     LAYOUT: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Quantize a whole row `y` (fp32, 0 past `n`) held in one block."""
    mask = offs < n
    if LAYOUT == _TOKEN:
        scale = _scale_of(tl.max(tl.abs(y), 0))
        tl.store(s_row, scale)
        tl.store(q_row + offs, _fp8(y, scale), mask=mask)
    elif LAYOUT == _GROUP:
        _store_groups(y, 0, n, q_row, s_row, stride_sg, GROUP_SIZE, BLOCK)
    else:
        tl.store(q_row + offs, _fp8(y, tl.load(static_ptr)), mask=mask)


@triton.jit
def _store_groups(y, start, n, q_row, s_row, stride_sg,
                  GROUP_SIZE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Columns start.. start + BLOCK (`start` a multiple of GROUP_SIZE) in groups of
    GROUP_SIZE: one scale each, at `s_row + (column // GROUP_SIZE) * stride_sg`."""
    offs = start + tl.arange(0, BLOCK)
    groups = tl.reshape(y, (BLOCK // GROUP_SIZE, GROUP_SIZE))
    scale = _scale_of(tl.max(tl.abs(groups), 1))
    q = tl.reshape(_fp8(groups, scale[:, None]), (BLOCK,))
    tl.store(q_row + offs, q, mask=offs < n)
    g = start // GROUP_SIZE + tl.arange(0, BLOCK // GROUP_SIZE)
    tl.store(s_row + g * stride_sg, scale, mask=g * GROUP_SIZE < n)


# fmt: off
@triton.jit
def _rms_norm_fp8_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, static_ptr,
    stride_x, stride_r, n, stride_sm, stride_sg, eps,
    HAS_RESIDUAL: tl.constexpr, OUT_DTYPE: tl.constexpr, LAYOUT: tl.constexpr,
    GROUP_SIZE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    # fmt: on
    """Row r: the math of `fused_ops._rms_norm_kernel`, rounded to OUT_DTYPE, then FP8."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * n + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = ((xf * rstd).to(x.dtype).to(tl.float32) * w).to(OUT_DTYPE).to(tl.float32)
    _store_quantized(y, offs, n, q_ptr + row * n, s_ptr + row * stride_sm, stride_sg,
                     static_ptr, LAYOUT, GROUP_SIZE, BLOCK)  # fmt: skip


@triton.jit
def _row_values(x_row, n, offs, SILU: tl.constexpr):
    """Columns `offs` of a row in the input dtype, 0 past `n`: the input itself, or
    `fused_ops`'s silu(gate) * up rounded to the input dtype."""
    mask = offs < n
    if SILU:
        gate = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + n + offs, mask=mask, other=0.0)
        silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
        y = (silu.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
    else:
        y = tl.load(x_row + offs, mask=mask, other=0.0)
    return y


@triton.jit
def _row(x_row, n, offs, SILU: tl.constexpr):
    """`_row_values` as fp32."""
    return _row_values(x_row, n, offs, SILU).to(tl.float32)


@triton.jit
def _piece_amax(amax, y):
    return tl.maximum(amax, tl.max(tl.abs(y.to(tl.float32)), 0))


@triton.jit
def _store_piece(q_row, offs, n, y, scale):
    tl.store(q_row + offs, _fp8(y.to(tl.float32), scale), mask=offs < n)


# fmt: off
@triton.jit
def _whole_row_kernel(
    x_ptr, q_ptr, s_ptr, stride_x, n, SILU: tl.constexpr,
    P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, PDL: tl.constexpr = False,
):
    # fmt: on
    """Program r: row r held whole as blocks of P0, P1 and P2 columns (P1, P2 may be 0) in the
    input dtype (each value is rounded to it anyway, so holding it there is exact and takes
    half the registers of fp32): one read of the row, its amax, its scale, then the FP8 codes.
    """
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * n
    o0 = tl.arange(0, P0)
    y0 = _row_values(x_row, n, o0, SILU)
    amax = _piece_amax(0.0, y0)
    if P1 > 0:
        o1 = P0 + tl.arange(0, P1)
        y1 = _row_values(x_row, n, o1, SILU)
        amax = _piece_amax(amax, y1)
    if P2 > 0:
        o2 = P0 + P1 + tl.arange(0, P2)
        y2 = _row_values(x_row, n, o2, SILU)
        amax = _piece_amax(amax, y2)
    scale = _scale_of(amax)
    tl.store(s_ptr + row, scale)
    _store_piece(q_row, o0, n, y0, scale)
    if P1 > 0:
        _store_piece(q_row, o1, n, y1, scale)
    if P2 > 0:
        _store_piece(q_row, o2, n, y2, scale)


@triton.jit
def _chunk_amax_kernel(x_ptr, amax_ptr, stride_x, n, num_parts,
                       SILU: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """Program (r, c): the amax of `_row` r over columns c*BLOCK.., into amax[r, c]."""
    pdl_prologue(PDL)
    row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
    y = _row(x_ptr + row * stride_x, n, part * BLOCK + tl.arange(0, BLOCK), SILU)
    tl.store(amax_ptr + row * num_parts + part, tl.max(tl.abs(y), 0))


# fmt: off
@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, static_ptr, amax_ptr, stride_x, n, stride_sm, stride_sg, span, num_parts,
    SILU: tl.constexpr, LAYOUT: tl.constexpr, AMAX: tl.constexpr, GROUP_SIZE: tl.constexpr,
    PARTS: tl.constexpr, STEP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    # fmt: on
    """Program (r, c) quantizes columns [c * span, (c + 1) * span) of `_row` r, BLOCK at a
    time (span a multiple of BLOCK). Per-token scales need the row's amax first: AMAX ==
    _PARTIALS reads the num_parts chunk maxima `_chunk_amax_kernel` left in amax[r, :]
    (PARTS, a power of two, covers them); AMAX == _RECOMPUTE makes a pass over the whole row,
    STEP columns at a time (the row is recomputed, not kept). Program (r, 0) stores the
    scale.
    Group and static scales need no row-wide value (span == BLOCK)."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * n
    s_row = s_ptr + row * stride_sm
    offs = tl.arange(0, BLOCK)
    lo = tl.program_id(1) * span
    if LAYOUT == _TOKEN:
        if AMAX == _PARTIALS:
            parts = tl.arange(0, PARTS)
            amax = tl.load(amax_ptr + row * num_parts + parts, mask=parts < num_parts, other=0.0)
        else:
            steps = tl.arange(0, STEP)
            amax = tl.zeros([STEP], dtype=tl.float32)
            for start in range(0, n, STEP):
                amax = tl.maximum(amax, tl.abs(_row(x_row, n, start + steps, SILU)))
        scale = _scale_of(tl.max(amax, 0))
        if tl.program_id(1) == 0:
            tl.store(s_row, scale)
        for start in range(lo, tl.minimum(lo + span, n), BLOCK):
            y = _row(x_row, n, start + offs, SILU)
            tl.store(q_row + start + offs, _fp8(y, scale), mask=start + offs < n)
    else:
        y = _row(x_row, n, lo + offs, SILU)
        if LAYOUT == _GROUP:
            _store_groups(y, lo, n, q_row, s_row, stride_sg, GROUP_SIZE, BLOCK)
        else:
            scale = tl.load(static_ptr)
            tl.store(q_row + lo + offs, _fp8(y, scale), mask=lo + offs < n)


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    quant: ActivationQuant,
) -> tuple[Fp8Activation, torch.Tensor | None]:
    """`fused_ops.rms_norm` emitting FP8 in `quant`'s layout: (the normalised rows, and with
    `residual` the new residual x + residual, else None)."""
    n = x.shape[-1]
    if weight.shape != (n,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(
            f"rms_norm_fp8: x {tuple(x.shape)}, weight {tuple(weight.shape)}, residual "
            f"{None if residual is None else tuple(residual.shape)}"
        )
    out_dtype = torch.result_type(weight, x)
    x2 = _rows(x)
    res2 = x2 if residual is None else _rows(residual)
    res_out = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    act, static = _outputs(x2, n, out_dtype, quant)
    if x2.shape[0]:
        block = max(triton.next_power_of_2(n), quant.group if quant.layout == "group" else 1)
        _rms_norm_fp8_kernel[(x2.shape[0],)](
            x2, res2, weight, act.data, act.scale, x2 if res_out is None else res_out, static,
            x2.stride(0), res2.stride(0), n, *_scale_strides(act), eps,
            HAS_RESIDUAL=residual is not None, OUT_DTYPE=_TL_DTYPE[out_dtype],
            LAYOUT=_LAYOUT[quant.layout], GROUP_SIZE=quant.group, BLOCK=block,
            num_warps=_row_warps(block), **pdl_args(x2.device),
        )  # fmt: skip
    return _shaped(act, x.shape), res_out


def silu_and_mul_fp8(
    x: torch.Tensor, quant: ActivationQuant, token_path: str | None = None
) -> Fp8Activation:
    """`fused_ops.silu_and_mul` (last dim `[gate | up]`, 2n) emitting FP8 [..., n].
    `token_path`: see `quantize_fp8`."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul_fp8: last dim must be [gate | up], got {tuple(x.shape)}")
    return _quantize_rows(x, x.shape[-1] // 2, quant, True, token_path)


def quantize_fp8(
    x: torch.Tensor, quant: ActivationQuant, token_path: str | None = None
) -> Fp8Activation:
    """`x` [..., K] to FP8 in `quant`'s layout. `token_path` (one of TOKEN_PATHS) forces how
    per-token scales are computed, for benchmarks and tests; by default `default_token_path`.
    Every path gives the same bits."""
    return _quantize_rows(x, x.shape[-1], quant, False, token_path)


def _quantize_rows(
    x: torch.Tensor, n: int, quant: ActivationQuant, silu: bool, token_path: str | None
) -> Fp8Activation:
    if token_path is not None and token_path not in TOKEN_PATHS:
        raise ValueError(f"token_path must be one of {TOKEN_PATHS}, got {token_path!r}")
    x2 = _rows(x)
    act, static = _outputs(x2, n, x.dtype, quant)
    m = x2.shape[0]
    if m and n and quant.layout == "token":
        path = token_path or default_token_path(m, n)
        _quantize_tokens(x2, n, act, silu, path)
    elif m and n:
        block = max(min(_CHUNK, triton.next_power_of_2(n)), quant.group)
        _quantize_rows_kernel[(m, triton.cdiv(n, block))](
            x2, act.data, act.scale, static, static, x2.stride(0), n, *_scale_strides(act), block,
            0,
            SILU=silu, LAYOUT=_LAYOUT[quant.layout], AMAX=_RECOMPUTE, GROUP_SIZE=quant.group,
            PARTS=1, STEP=block, BLOCK=block, num_warps=_row_warps(block), **pdl_args(x2.device),
        )  # fmt: skip
    return _shaped(act, (*x.shape[:-1], n))


def default_token_path(rows: int, columns: int) -> str:
    """Decode batches spread each row over many programs; a prefill batch reads each row
    once, held whole (up to WHOLE_MAX_COLUMNS)."""
    if rows > SPLIT_MAX_ROWS and columns <= WHOLE_MAX_COLUMNS:
        return "whole"
    return "partials"


def _quantize_tokens(x2: torch.Tensor, n: int, act: Fp8Activation, silu: bool, path: str) -> None:
    """Per-token scales by `path` (TOKEN_PATHS). The max of chunk maxima is the row's amax
    exactly, so the scale, and every byte, is the same on each path."""
    m = x2.shape[0]
    step = max(128, min(_TOKEN_STEP, triton.next_power_of_2(n)))  # tiles of >= 128 columns
    if path == "whole":
        if n > WHOLE_MAX_COLUMNS:
            raise ValueError(
                f"token_path 'whole' holds at most {WHOLE_MAX_COLUMNS} columns, got {n}"
            )
        p0, p1, p2 = whole_pieces(n)
        _whole_row_kernel[(m,)](
            x2, act.data, act.scale, x2.stride(0), n, SILU=silu, P0=p0, P1=p1, P2=p2,
            num_warps=whole_warps(n), **pdl_args(x2.device),
        )  # fmt: skip
        return
    if path == "row":
        block, parts, programs = step, 1, 1
        span = triton.cdiv(n, step) * step
    else:
        want = triton.next_power_of_2(triton.cdiv(m * n, _SPLIT_PROGRAMS))
        block = span = min(step, max(_SPLIT_MIN, min(_SPLIT_MAX, want)))
        parts = programs = triton.cdiv(n, block)
    amax = act.scale  # read only on the "partials" path
    if path == "partials":
        amax = torch.empty((m, parts), dtype=torch.float32, device=x2.device)
        _chunk_amax_kernel[(m, parts)](
            x2, amax, x2.stride(0), n, parts, SILU=silu, BLOCK=block, num_warps=_row_warps(block),
            **pdl_args(x2.device),
        )
    warps = _row_warps(block if path == "partials" else step)
    source = _PARTIALS if path == "partials" else _RECOMPUTE
    _quantize_rows_kernel[(m, programs)](
        x2, act.data, act.scale, act.scale, amax, x2.stride(0), n, 1, 1, span, parts,
        SILU=silu, LAYOUT=_LAYOUT["token"], AMAX=source, GROUP_SIZE=1,
        PARTS=triton.next_power_of_2(parts), STEP=step, BLOCK=block, num_warps=warps,
        **pdl_args(x2.device),
    )  # fmt: skip


def whole_pieces(n: int) -> tuple[int, int, int]:
    """Up to three powers of two (>= 128, zeros for unused) summing to at least `n`, the
    largest first: n itself where three suffice (18944 = 16384 + 2048 + 512), else the third
    rounded up."""
    pieces, rest = [], n
    while rest > 0 and len(pieces) < 2:
        piece = max(128, 1 << (rest.bit_length() - 1))
        pieces.append(piece)
        rest -= piece
    if rest > 0:
        pieces.append(max(128, triton.next_power_of_2(rest)))
    return tuple(pieces + [0] * (3 - len(pieces)))


def whole_warps(n: int) -> int:
    """Warps of a "whole" program: about 32 values of the row a thread, at most 16 warps (on
    an H200, 18944 columns took 302 us at 8192 rows with 16 warps, 402 with 32, 344 with 8)."""
    return max(4, min(16, triton.next_power_of_2(triton.cdiv(n, 32 * 32))))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as [M, last dim] with unit column stride (a view where one exists)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def _outputs(
    x2: torch.Tensor, n: int, dtype: torch.dtype, quant: ActivationQuant
) -> tuple[Fp8Activation, torch.Tensor]:
    """Empty FP8 rows [M, n] (as their uint8 bits, which the kernels store) with their scales,
    and the static scale pointer the kernel reads (any float32 tensor when dynamic)."""
    m = x2.shape[0]
    bits = torch.empty((m, n), dtype=torch.uint8, device=x2.device)
    if quant.layout == "static":
        if quant.scale.device != x2.device:
            raise ValueError(f"static scale on {quant.scale.device}, activation on {x2.device}")
        scale = static = quant.scale
    else:
        groups = -(-n // quant.group) if quant.layout == "group" else 1
        scale = static = torch.empty((m, groups), dtype=torch.float32, device=x2.device)
        if quant.layout == "group" and m_major(quant, m):
            scale = static = torch.empty((groups, m), dtype=torch.float32, device=x2.device).t()
    return Fp8Activation(bits, scale, dtype), static


def m_major(quant: ActivationQuant, rows: int) -> bool:
    """Whether `rows` rows' group scales are stored M-major (`ActivationQuant.m_major_from`)."""
    return quant.m_major_from is not None and rows >= quant.m_major_from and rows % 4 == 0


def _scale_strides(act: Fp8Activation) -> tuple[int, int]:
    """(row, group) strides of the scales the kernels store; 0 for a static scalar."""
    return tuple(act.scale.stride()) if act.scale.dim() == 2 else (0, 0)


def _shaped(act: Fp8Activation, shape: tuple[int, ...]) -> Fp8Activation:
    return Fp8Activation(act.data.view(FP8).view(shape), act.scale, act.dtype)
