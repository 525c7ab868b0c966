"""The Triton FP8 GEMMs (`fp8_gemm_kernels`) against the dequantizing reference of the same
quantized operands, and the microbenchmark's smoke run.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET must be set before
the kernel module is imported); with CUDA they run compiled, and `fp8_linear`'s dispatch is
checked too.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from common.model.kernels import fp8_gemm_kernels as kern  # noqa: E402
from common.model.kernels import fp8_quant, fused_ops, tma  # noqa: E402
from common.model.kernels.fp8_gemm_kernels import TileConfig  # noqa: E402
from common.model.quantization import fp8_gemm  # noqa: E402
from common.model.quantization import fp8_ops as ops  # noqa: E402
from common.model.quantization.activation import ActivationQuant  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
ROOT = Path(__file__).resolve().parents[1]
# fp32: accumulation order only; on Hopper also the tensor cores' ~14-bit FP8 accumulation
# within each promoted run of 128 columns. bf16: one rounding step (the interpreter truncates).
F32_TOL = 2e-3 if CUDA else 1e-4
TOL = {torch.float32: dict(rtol=F32_TOL, atol=F32_TOL), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
SWAP_SPLIT = TileConfig(16, 32, 64, 4, 2, True, split_k=3)
PLAIN_SPLIT = TileConfig(16, 64, 64, 4, 2, False, split_k=2)
WIDE = TileConfig(32, 32, 64, 4, 2, False, split_k=1)
TMA_SWAP = TileConfig(16, 32, 64, 4, 2, True, split_k=2, tma=True)
TMA_PLAIN = TileConfig(16, 64, 64, 4, 2, False, split_k=1, tma=True)


def operands(m: int, n: int, k: int, bias: bool):
    g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE) if bias else None
    return x, w, b


def block_case(m, n, k, bias, group=128):
    x, w, b = operands(m, n, k, bias)
    xq, xs = ops.quantize_per_token_group(x, group)
    wq, blocks = ops.quantize_weight_blocks(w, (group, group))
    rows = blocks.repeat_interleave(group, dim=0)[:n].contiguous()  # [N, KB]
    ref = fp8_gemm.reference_linear(
        xq, ops.expand_groups(xs, group, k), wq, ops.expand_groups(rows, group, k), torch.float32, b
    )
    return (xq, xs, wq, rows, group), b, ref


def channel_case(m, n, k, bias):
    x, w, b = operands(m, n, k, bias)
    (xq, xs), (wq, ws) = ops.quantize_per_token(x), ops.quantize_weight_per_channel(w)
    ws = ws.reshape(-1)
    return (xq, xs, wq, ws), b, fp8_gemm.reference_linear(xq, xs, wq, ws, torch.float32, b)


def assert_matches(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


# (M, N, K, bias, out dtype, config): M = 1, N and K off every tile (a partial last K group),
# both operand orders, split K, rows past M and N in a tile; b through TMA (rows past N and
# columns past K zero-filled by the copy), and a K whose rows are off 16 bytes, which falls back.
CASES = [
    (1, 70, 300, True, torch.float32, None),
    (1, 96, 256, False, torch.bfloat16, None),
    (5, 130, 200, True, torch.float32, SWAP_SPLIT),
    (17, 40, 384, False, torch.bfloat16, PLAIN_SPLIT),
    (33, 72, 136, True, torch.float32, WIDE),
    (70, 50, 128, False, torch.float32, None),
    (1, 70, 304, True, torch.float32, TMA_SWAP),
    (5, 130, 208, False, torch.bfloat16, TMA_PLAIN),
    (3, 40, 300, True, torch.float32, TMA_SWAP),
]


def test_tma_reads_only_rows_on_16_byte_boundaries():
    hopper = not CUDA or torch.cuda.get_device_capability()[0] >= 9
    wq = torch.zeros(8, 304, dtype=kern.FP8, device=DEVICE)
    assert tma.rows_fit(wq) == (tma.TensorDescriptor is not None and hopper)
    assert not tma.rows_fit(torch.zeros(8, 300, dtype=kern.FP8, device=DEVICE))
    assert not tma.rows_fit(wq[:, 1:])  # the base off 16 bytes


@pytest.mark.parametrize("m,n,k,bias,dtype,config", CASES)
def test_block_kernel_matches_the_dequantizing_reference(m, n, k, bias, dtype, config):
    args, b, ref = block_case(m, n, k, bias)
    assert_matches(kern.w8a8_block_mm(*args, dtype, b, config), ref, dtype)


def test_block_kernel_takes_other_power_of_two_groups():
    args, b, ref = block_case(9, 80, 200, True, group=64)
    assert_matches(kern.w8a8_block_mm(*args, torch.float32, b), ref, torch.float32)


def test_block_fp8_linear_cuda_is_the_block_kernel():
    args, b, ref = block_case(3, 48, 256, True)
    out = fp8_gemm.block_fp8_linear_cuda(*args, torch.bfloat16, b)
    assert_matches(out, ref, torch.bfloat16)


@pytest.mark.parametrize("m,n,k,bias,dtype,config", CASES)
def test_channel_kernel_matches_the_dequantizing_reference(m, n, k, bias, dtype, config):
    args, b, ref = channel_case(m, n, k, bias)
    assert_matches(kern.w8a8_channel_mm(*args, dtype, b, config), ref, dtype)


@pytest.mark.parametrize("scalar_x,scalar_w", [(True, True), (True, False), (False, True)])
def test_channel_kernel_takes_scalar_scales_on_either_side(scalar_x, scalar_w):
    (xq, xs, wq, ws), b, _ = channel_case(4, 40, 96, True)
    xs = xs.amax().reshape(()) if scalar_x else xs.reshape(-1)  # [M] as well as [M, 1]
    ws = ws.amax().reshape(()) if scalar_w else ws
    ref = fp8_gemm.reference_linear(xq, xs.reshape(-1, 1), wq, ws, torch.float32, b)
    assert_matches(kern.w8a8_channel_mm(xq, xs, wq, ws, torch.float32, b), ref, torch.float32)


def test_split_k_is_deterministic_and_agrees_with_one_split():
    (xq, xs, wq, rows, g), _, _ = block_case(6, 64, 512, False)
    one = kern.w8a8_block_mm(xq, xs, wq, rows, g, torch.float32, None, WIDE)
    split = TileConfig(16, 32, 128, 4, 2, True, split_k=4)
    first = kern.w8a8_block_mm(xq, xs, wq, rows, g, torch.float32, None, split)
    again = kern.w8a8_block_mm(xq, xs, wq, rows, g, torch.float32, None, split)
    assert torch.equal(first, again)  # partials summed in a fixed order, no atomics
    torch.testing.assert_close(first, one, **TOL[torch.float32])


def test_scale_epilogue_applies_row_and_column_scales_and_bias():
    acc = torch.randn(5, 300).to(DEVICE)
    sx, sw = torch.rand(5, 1).to(DEVICE), torch.rand(300).to(DEVICE)
    bias = torch.randn(300).to(DEVICE).to(torch.bfloat16)
    out = kern.scale_epilogue(acc, sx, sw, torch.float32, bias)
    torch.testing.assert_close(out, acc * sx * sw + bias.float(), rtol=1e-6, atol=1e-6)


def test_split_k_grows_only_where_output_tiles_leave_sms_idle():
    decode = kern.pick_config(1, block_scaled=False)
    assert kern.split_k_for(1, 4608, 3584, decode, 132) > 1  # 72 tiles on 132 SMs
    assert kern.split_k_for(1, 37888, 3584, decode, 132) == 1  # 592 tiles
    m64 = kern.pick_config(64, block_scaled=False)
    assert kern.split_k_for(64, 4608, 3584, m64, 132) == 1  # partials too big
    assert kern.split_k_for(1, 64, 512, decode, 132) == 1  # 2 K tiles: nothing to split


def test_bad_operands_are_refused_naming_the_values():
    (xq, xs, wq, rows, g), _, _ = block_case(2, 32, 256, False)
    with pytest.raises(ValueError, match=r"differ in K"):
        kern.w8a8_block_mm(xq, xs, wq[:, :128], rows, g, torch.float32)
    with pytest.raises(ValueError, match=r"group_k must be a power of two >= 16, got 100"):
        kern.w8a8_block_mm(xq, xs, wq, rows, 100, torch.float32)
    with pytest.raises(ValueError, match=r"a \[2, 2\] and b \[32, 2\].*got \(2, 1\)"):
        kern.w8a8_block_mm(xq, xs[:, :1], wq, rows, g, torch.float32)
    with pytest.raises(ValueError, match=r"float8_e4m3fn.*bfloat16"):
        kern.w8a8_channel_mm(xq.to(torch.bfloat16), xs[:, :1], wq, rows[:, 0], torch.float32)
    with pytest.raises(ValueError, match=r"b_scale must be a scalar or hold one value per row"):
        kern.w8a8_channel_mm(xq, xs[:, :1], wq, rows[:5, 0], torch.float32)
    with pytest.raises(ValueError, match=r"out_dtype"):
        kern.w8a8_channel_mm(xq, xs[:, :1], wq, rows[:, 0], torch.int32)
    with pytest.raises(ValueError, match=r"K blocks in multiples of 4, got 2"):
        fp8_gemm.block_scaled_mm_linear(xq, xs, wq, rows[:1], torch.bfloat16, None)


@pytest.mark.parametrize("silu", [False, True])  # o_proj's input, down_proj's
# 64 rows (the interpreter's slowest) at the short K only
@pytest.mark.parametrize(("m", "k"), [(1, 128), (3, 128), (17, 128), (64, 128), (1, 3584),
                                      (3, 3584), (17, 3584)])  # fmt: skip
def test_decode_quantization_then_channel_kernel_equals_the_row_path_and_reference(m, k, silu):
    """The split per-token quantization feeds the GEMM the very bytes and scales of one
    program per row, so the product is identical; both match the dequantizing reference."""
    x, w, _ = operands(m, 64, 2 * k if silu else k, False)
    x, token = x.to(torch.bfloat16), ActivationQuant("token")
    if silu:
        w = w[:, :k]
        quantize = functools.partial(fp8_quant.silu_and_mul_fp8, x, token)
    else:
        quantize = functools.partial(fp8_quant.quantize_fp8, x, token)
    wq, ws = ops.quantize_weight_per_channel(w)
    ws = ws.reshape(-1)
    assert fp8_quant.default_token_path(m, k) == "partials"
    outs = []
    for act in (quantize(), quantize(token_path="row")):
        outs.append(kern.w8a8_channel_mm(act.data, act.scale, wq, ws, torch.bfloat16))
    assert torch.equal(outs[0], outs[1])
    inputs = fused_ops.silu_and_mul(x) if silu else x
    xq, xs = ops.quantize_per_token(inputs)
    ref = fp8_gemm.reference_linear(xq, xs, wq, ws, torch.float32, None)
    assert_matches(outs[0], ref, torch.bfloat16)


@pytest.mark.skipif(not CUDA, reason="fp8_linear dispatches on CUDA only")
@pytest.mark.parametrize("m", [1, 64, 200, 1024])
def test_fp8_linear_dispatch_matches_the_reference_at_every_m(m):
    args, b, ref = channel_case(m, 256, 512, True)
    assert_matches(fp8_gemm.fp8_linear(*args, torch.bfloat16, b), ref, torch.bfloat16)
    unit = fp8_gemm.unit_scale_mm_linear(*args, torch.bfloat16, b)
    assert_matches(unit, ref, torch.bfloat16)


@pytest.mark.skipif(not CUDA, reason="cuBLASLt's block-scaled GEMM runs on CUDA only")
@pytest.mark.parametrize("m", [3, 130, 256])
@pytest.mark.parametrize("m_major", [False, True])  # activation scales as stored for cuBLASLt
def test_block_dispatch_with_block_scales_matches_the_reference(m, m_major):
    (xq, xs, wq, rows, g), b, ref = block_case(m, 384, 1024, True)
    if m_major:
        xs = xs.t().contiguous().t()
    _, blocks = ops.quantize_weight_blocks(operands(m, 384, 1024, True)[1], (g, g))
    for given in (blocks, None):  # cuBLASLt above 64 rows, else the Triton kernel
        out = fp8_gemm.block_fp8_linear_cuda(xq, xs, wq, rows, g, torch.bfloat16, b, given)
        assert_matches(out, ref, torch.bfloat16)


@pytest.mark.skipif(not CUDA, reason="the cuBLASLt paths run on CUDA only")
@pytest.mark.parametrize("m", [3, 64, 256, 1024])
def test_every_fp8_gemm_path_writes_a_given_buffer(m):
    """`out` (a prefill graph's static qkv buffer): cuBLASLt writes it directly where it can,
    the other paths copy their result in; the values equal the path's own output tensor."""
    (xq, xs, wq, rows, g), _, _ = block_case(m, 384, 1024, False)
    _, blocks = ops.quantize_weight_blocks(operands(m, 384, 1024, False)[1], (g, g))
    channel, bias, _ = channel_case(m, 256, 512, True)
    runs = [
        lambda out: fp8_gemm.block_fp8_linear_cuda(
            xq, xs, wq, rows, g, torch.bfloat16, None, blocks, out
        ),
        lambda out: fp8_gemm.fp8_linear(*channel, torch.bfloat16, bias, out),
        lambda out: fp8_gemm.fp8_linear(*channel, torch.bfloat16, None, out),
    ]
    for run in runs:
        expected = run(None)
        buffer = torch.full((m + 4, expected.shape[1]), float("nan"), dtype=torch.bfloat16,
                            device=DEVICE)  # fmt: skip
        out = run(buffer[:m])
        assert out.data_ptr() == buffer.data_ptr() and torch.equal(buffer[:m], expected)
        assert buffer[m:].isnan().all()


def test_benchmark_smoke_run_checks_every_triton_candidate(tmp_path):
    out = tmp_path / "fp8.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = ROOT / "benchmarks" / "bench_fp8_linear.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = [r for r in report["detail"] if r["candidate"] in ("triton_chan", "triton_block")]
    assert len(rows) == 2 * 5 * 2  # both kernels, five linears, two M
    assert all(r["status"] == "ok" and r["max_rel_err"] < report["tol"] for r in rows)
    assert report["models"]["tiny"]["per_m"]["1"]["bf16"]["eager_ms"] > 0
    alone = [r for r in report["detail"] if r["candidate"].startswith(("quant[", "silu["))]
    assert len(alone) == 8 * 5 * 2  # four paths x (quantize, silu), five linears, two M
    assert all(r["status"] == "ok" and r["max_rel_err"] == 0 for r in alone)  # the same codes
    errors = {}
    for r in report["detail"]:
        if r["candidate"] in ("quant_disp", "q_row_disp"):
            errors.setdefault((r["layer"], r["m"]), set()).add(r["max_rel_err"])
    assert len(errors) == 10 and all(len(e) == 1 for e in errors.values())  # the same output
