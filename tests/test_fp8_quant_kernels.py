"""The FP8-emitting kernels (`common.model.kernels.fp8_quant`) equal the unfused path bit for
bit: `fused_ops.rms_norm` / `fused_ops.silu_and_mul` (the same device, the same rounding to the
model dtype) followed by the `fp8_ops` quantization, FP8 bytes and scales alike.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET must be set before
the kernels are decorated, hence before any import below).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from common.model.kernels import fp8_quant, fused_ops  # noqa: E402
from common.model.quantization.activation import (  # noqa: E402
    ActivationQuant,
    Fp8Activation,
    quantize_activation,
)
from common.model.quantization.fp8_ops import MIN_SCALE  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


def quant(layout: str) -> ActivationQuant:
    if layout == "static":
        return ActivationQuant("static", scale=torch.tensor(0.004, device=DEVICE))
    return ActivationQuant(layout)


def rows(m: int, n: int, dtype: torch.dtype, zero_row: int | None = 2) -> torch.Tensor:
    """Random rows of mixed magnitude (some clip at a static scale), one of them all zero."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, n, generator=g) * torch.logspace(-3, 1, m).unsqueeze(1)
    if zero_row is not None:
        x[zero_row] = 0
    return x.to(dtype).to(DEVICE)


def assert_bit_equal(got: Fp8Activation, want: Fp8Activation) -> None:
    assert got.data.dtype == torch.float8_e4m3fn and got.data.shape == want.data.shape
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert got.scale.shape == want.scale.shape and torch.equal(got.scale, want.scale)
    assert got.dtype == want.dtype


def assert_an_ulp_apart(got: Fp8Activation, want: Fp8Activation) -> None:
    """Scales at most two ulps apart (an amax an ulp off, then the rounding of its product
    with 1/448), FP8 codes at most one step (adjacent codes of one sign are adjacent bytes)."""
    torch.testing.assert_close(got.scale, want.scale, rtol=5e-7, atol=0)
    steps = got.data.view(torch.uint8).int() - want.data.view(torch.uint8).int()
    assert steps.abs().max() <= 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["token", "group", "static"])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("n", [200, 4096])  # 200: two groups of 128, the last one short
def test_rms_norm_fp8_equals_the_norm_kernel_then_fp8_ops(dtype, layout, with_residual, n):
    x, weight = rows(5, n, dtype), rows(1, n, dtype, zero_row=None)[0] + 1
    residual = rows(5, n, dtype) * 3 if with_residual else None
    q = quant(layout)
    got, new_residual = fp8_quant.rms_norm_fp8(x, weight, EPS, residual, q)
    if residual is None:
        want = quantize_activation(fused_ops.rms_norm(x, weight, EPS), q)
        assert new_residual is None
    else:
        y, want_residual = fused_ops.rms_norm(x, weight, EPS, residual)
        want = quantize_activation(y, q)
        assert torch.equal(new_residual, want_residual)
    if dtype == torch.float32 and not INTERPRET:
        # Compiled, the sum of squares is reduced in an order Triton derives from the tensor
        # layout, which follows what a kernel stores (bytes here, floats in fused_ops): the
        # float32 rstd may differ in its last ulp (seen on an H200 at n = 4096). In bfloat16
        # the rounding to the model dtype absorbed it in every case tried there.
        assert_an_ulp_apart(got, want)
    else:
        assert_bit_equal(got, want)
    if layout != "static":  # row 2 of x (and of residual) is zero: the floor, not NaN
        assert torch.all(got.scale[2] == MIN_SCALE) and torch.all(got.data[2].float() == 0)


def test_an_all_zero_row_gets_the_floor_scale_and_zero_bytes():
    x = torch.zeros(2, 200, device=DEVICE)
    for layout in ("token", "group"):
        got, _ = fp8_quant.rms_norm_fp8(x, torch.ones(200, device=DEVICE), EPS, None, quant(layout))
        assert torch.all(got.scale == MIN_SCALE)
        assert torch.all(got.data.view(torch.uint8) == 0)
        assert got.scale.shape == ((2, 1) if layout == "token" else (2, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["token", "group", "static"])
@pytest.mark.parametrize("n", [200, 9000])  # 9000: two 8192-column steps, 9 chunks
def test_silu_and_mul_fp8_equals_the_silu_kernel_then_fp8_ops(dtype, layout, n):
    x = rows(4, 2 * n, dtype)
    got = fp8_quant.silu_and_mul_fp8(x, quant(layout))
    assert_bit_equal(got, quantize_activation(fused_ops.silu_and_mul(x), quant(layout)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["token", "group", "static"])
def test_quantize_fp8_of_strided_3d_rows_equals_fp8_ops(dtype, layout):
    wide = rows(6, 400, dtype)
    x = wide[:, :300].reshape(2, 3, 300)  # not contiguous rows: a copy, then one launch
    got = fp8_quant.quantize_fp8(x, quant(layout))
    assert got.data.shape == (2, 3, 300)
    assert_bit_equal(got, quantize_activation(x, quant(layout)))
    strided = wide[:, :300]  # row stride 400, last dim contiguous: no copy
    assert_bit_equal(
        fp8_quant.quantize_fp8(strided, quant(layout)),
        quantize_activation(strided, quant(layout)),
    )


@pytest.mark.parametrize("m,m_major", [(8, True), (6, False), (4, False)])
def test_group_scales_asked_m_major_are_stored_so_with_the_same_values(m, m_major):
    """From `m_major_from` (8) rows, if a multiple of 4: strides (1, M), cuBLASLt's layout."""
    q = ActivationQuant("group", m_major_from=8)
    x, weight = rows(m, 300, torch.bfloat16), rows(1, 300, torch.bfloat16, zero_row=None)[0] + 1
    producers = [
        (fp8_quant.rms_norm_fp8(x, weight, EPS, None, q)[0], fused_ops.rms_norm(x, weight, EPS)),
        (fp8_quant.quantize_fp8(x, q), x),
        (fp8_quant.silu_and_mul_fp8(rows(m, 600, torch.bfloat16), q), None),
    ]
    for got, source in producers:
        assert got.scale.stride() == ((1, m) if m_major else (3, 1))
        if source is not None:
            assert_bit_equal(got, quantize_activation(source, q))
    silu = fused_ops.silu_and_mul(rows(m, 600, torch.bfloat16))
    assert_bit_equal(producers[2][0], quantize_activation(silu, q))


def test_e4m3_rounding_matches_torch_at_every_tie_carry_and_subnormal():
    """Every FP8 value, every midpoint between two (ties go to even) and the floats either
    side of it, positive and negative, subnormals and the 448 clamp included."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[~values.isnan()].unique()
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.tensor(1e9), torch.tensor(-1e9)
    x = torch.cat([values, mids, mids.nextafter(up), mids.nextafter(down), torch.tensor([1e4])])
    x = torch.cat([x, -x]).to(DEVICE)
    one = ActivationQuant("static", scale=torch.tensor(1.0, device=DEVICE))
    got = fp8_quant.quantize_fp8(x.unsqueeze(0), one)
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(got.data[0].view(torch.uint8), want.view(torch.uint8))


def test_empty_batches_launch_nothing_and_keep_their_shapes():
    x = torch.empty(0, 256, device=DEVICE)
    act = fp8_quant.quantize_fp8(x, quant("group"))
    assert act.data.shape == (0, 256) and act.scale.shape == (0, 2)
    act, res = fp8_quant.rms_norm_fp8(x, torch.ones(256, device=DEVICE), EPS, x, quant("token"))
    assert act.data.shape == (0, 256) and res.shape == (0, 256)


def test_bad_specs_and_shapes_are_value_errors_naming_them():
    with pytest.raises(ValueError, match="'channel'"):
        ActivationQuant("channel")
    with pytest.raises(ValueError, match="power of two, got 100"):
        ActivationQuant("group", group=100)
    with pytest.raises(ValueError, match="static layout only"):
        ActivationQuant("static")
    with pytest.raises(ValueError, match="one float32"):
        ActivationQuant("static", scale=torch.ones(2))
    with pytest.raises(ValueError, match=r"\(3, 5\)"):
        fp8_quant.silu_and_mul_fp8(torch.ones(3, 5, device=DEVICE), quant("token"))
    with pytest.raises(ValueError, match=r"weight \(8,\)"):
        fp8_quant.rms_norm_fp8(
            torch.ones(3, 5, device=DEVICE), torch.ones(8, device=DEVICE), EPS, None, quant("token")
        )


@pytest.mark.parametrize("path", fp8_quant.TOKEN_PATHS)
@pytest.mark.parametrize("silu", [False, True])
# 3584: Qwen2.5-7B's hidden size, chunks of 256+; 64 rows (the interpreter's slowest) at 128
@pytest.mark.parametrize(("m", "n"), [(1, 128), (3, 128), (17, 128), (64, 128), (1, 3584),
                                      (3, 3584), (17, 3584)])  # fmt: skip
def test_every_per_token_path_gives_the_fp8_ops_bits(path, silu, m, n):
    x = rows(m, 2 * n if silu else n, torch.bfloat16, zero_row=2 if m > 2 else None)
    if silu:
        got = fp8_quant.silu_and_mul_fp8(x, quant("token"), token_path=path)
        want = quantize_activation(fused_ops.silu_and_mul(x), quant("token"))
    else:
        got = fp8_quant.quantize_fp8(x, quant("token"), token_path=path)
        want = quantize_activation(x, quant("token"))
    assert_bit_equal(got, want)
    if m > 2:
        assert torch.all(got.scale[2] == MIN_SCALE)  # the all-zero row: the floor, not NaN


@pytest.mark.parametrize("path", ["partials", "recompute", "whole"])
def test_a_down_proj_wide_row_split_over_many_chunks_equals_one_program_per_row(path):
    x = rows(2, 2 * 18944, torch.bfloat16, zero_row=None)  # Qwen2.5-7B's [gate | up]
    got = fp8_quant.silu_and_mul_fp8(x, quant("token"), token_path=path)
    assert_bit_equal(got, fp8_quant.silu_and_mul_fp8(x, quant("token"), token_path="row"))


def test_decode_batches_split_and_prefill_rows_go_whole():
    prefill, widest = fp8_quant.SPLIT_MAX_ROWS + 1, fp8_quant.WHOLE_MAX_COLUMNS
    assert fp8_quant.default_token_path(1, 3584) == "partials"
    assert fp8_quant.default_token_path(fp8_quant.SPLIT_MAX_ROWS, 18944) == "partials"
    assert fp8_quant.default_token_path(prefill, 3584) == "whole"
    assert fp8_quant.default_token_path(prefill, 18944) == "whole"  # down_proj's
    assert fp8_quant.default_token_path(prefill, widest + 1) == "partials"


def test_the_whole_row_path_refuses_a_row_wider_than_it_holds():
    x = torch.ones(1, fp8_quant.WHOLE_MAX_COLUMNS + 16, device=DEVICE)
    with pytest.raises(ValueError, match="'whole' holds at most 32768 columns, got 32784"):
        fp8_quant.quantize_fp8(x, quant("token"), "whole")


def test_a_row_is_held_in_at_most_three_power_of_two_pieces():
    assert fp8_quant.whole_pieces(18944) == (16384, 2048, 512)  # Qwen2.5-7B's down_proj input
    assert fp8_quant.whole_pieces(12288) == (8192, 4096, 0)  # Qwen3-8B's
    assert fp8_quant.whole_pieces(3584) == (2048, 1024, 512)
    assert fp8_quant.whole_pieces(100) == (128, 0, 0)
    assert fp8_quant.whole_pieces(3648) == (2048, 1024, 1024)  # four needed: the third rounds up


def test_an_unknown_token_path_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="'columns'"):
        fp8_quant.quantize_fp8(torch.ones(2, 8, device=DEVICE), quant("token"), "columns")
