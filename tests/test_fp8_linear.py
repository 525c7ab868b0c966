"""FP8 pieces on their own: the activation-quantization helpers, the two GEMM paths, and each
method's scale loaders at TP 2 (`TPGroup(rank, 2)` without process groups: loading needs no
collectives)."""

from __future__ import annotations

import pytest
import torch

from common.model.distributed import TPGroup
from common.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    process_weights_after_loading,
)
from common.model.parallel import TPLayout
from common.model.quantization import fp8_ops as ops
from common.model.quantization.config import QuantConfig
from common.model.quantization.fp8 import Fp8BlockMethod, Fp8PerChannelMethod, Fp8PerTensorMethod
from common.model.quantization.fp8_gemm import reference_linear, scaled_mm_linear
from tests.test_linear_layers import SPEC

g = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def test_per_token_scale_is_row_amax_over_448_and_zero_rows_get_the_floor():
    x = torch.tensor([[1.0, -896.0, 2.0], [0.0, 0.0, 0.0]])
    q, scale = ops.quantize_per_token(x)
    assert scale.shape == (2, 1) and scale.dtype == torch.float32
    assert scale[0, 0] == 2.0 and scale[1, 0] == ops.MIN_SCALE
    assert q.dtype == torch.float8_e4m3fn
    assert q.float()[0].tolist() == [0.5, -448.0, 1.0] and not q.float().isnan().any()


def test_static_scale_clamps_to_448_instead_of_overflowing():
    q = ops.quantize_per_tensor(torch.tensor([1e6, -1e6, 3.0]), torch.tensor(1.0))
    assert q.float().tolist() == [448.0, -448.0, 3.0]


def test_rounding_is_to_nearest_e4m3():
    # Between 256 and 288 e4m3 has no value: 270 rounds to 256, 275 to 288.
    q = ops.quantize_per_tensor(torch.tensor([270.0, 275.0]), torch.tensor(1.0))
    assert q.float().tolist() == [256.0, 288.0]


def test_token_groups_of_128_with_a_short_last_group():
    x = randn(3, 200)
    x[1, 130] = 1000.0
    q, scale = ops.quantize_per_token_group(x, 128)
    assert q.shape == (3, 200) and scale.shape == (3, 2)
    assert scale[1, 1] == 1000.0 / 448
    assert torch.equal(scale[0, 0], x[0, :128].abs().amax() * ops.INV_FP8_MAX)
    back = q.float() * ops.expand_groups(scale, 128, 200)
    assert (back - x).abs().max() <= x.abs().max() / 448 * 16  # within half an e4m3 step


def test_weight_blocks_cover_partial_edge_blocks():
    w = randn(130, 300)
    q, scale = ops.quantize_weight_blocks(w, (128, 128))
    assert scale.shape == (2, 3)
    assert torch.equal(scale[1, 2], w[128:, 256:].abs().amax() * ops.INV_FP8_MAX)
    assert ops.expand_blocks(scale, (128, 128), (130, 300)).shape == (130, 300)


@pytest.mark.parametrize("rowwise", [False, True])
def test_scaled_mm_path_matches_the_dequantizing_reference(rowwise):
    """The CUDA path's `_scaled_mm` call against the reference the CPU suite uses: on a GPU
    when there is one, else on CPU, whose row-wise support depends on the torch version (2.13
    has it, 2.11 does not)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, w = randn(5, 64).to(device), randn(48, 64).to(device)
    if rowwise:
        (xq, xs), (wq, ws) = ops.quantize_per_token(x), ops.quantize_weight_per_channel(w)
        ws = ws.reshape(-1)
    else:
        xs = torch.tensor(0.01)
        xq, (wq, ws) = ops.quantize_per_tensor(x, xs), ops.quantize_weight_per_tensor(w)
    version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    if rowwise and device == "cpu" and version < (2, 13):
        pytest.skip(f"torch {torch.__version__} runs CPU _scaled_mm with per-tensor scales only")
    fast = scaled_mm_linear(xq, xs.to(device), wq, ws, torch.float32, None)
    ref = reference_linear(xq, xs, wq, ws, torch.float32, None)
    torch.testing.assert_close(fast, ref, rtol=1e-2, atol=1e-2)  # bf16 output of row-wise


def qkv(method, rank: int, head_dim: int = 16, hidden: int = 64):
    tp = TPGroup(rank, 2)
    spec = SPEC if head_dim == 16 else _block_spec()
    return QKVParallelLinear(hidden, head_dim, TPLayout.of(spec, 2), tp, method=method)


def _block_spec():
    import dataclasses

    return dataclasses.replace(SPEC, hidden_size=256, num_heads=2, num_kv_heads=2, head_dim=128)


def test_per_channel_scales_follow_the_output_rows_at_tp2():
    method = Fp8PerChannelMethod(QuantConfig("channel", "token"))
    scales = [torch.arange(n, dtype=torch.float32).reshape(n, 1) + 1 for n in (64, 32, 32)]
    for rank in (0, 1):
        layer = qkv(method, rank)
        for shard, s in enumerate(scales):
            layer.weight_scale.weight_loader(layer.weight_scale, s, shard)
        # rank r: q rows 32r..32r+31, then its KV head's 16 rows of k and of v
        q, k, v = (
            scales[0][32 * rank :][:32],
            scales[1][16 * rank :][:16],
            scales[2][16 * rank :][:16],
        )
        expected = torch.cat([q, k, v])
        assert torch.equal(layer.weight_scale.data, expected)
    row = RowParallelLinear(128, 64, TPGroup(1, 2), method=method)
    full = randn(64, 1).abs()
    row.weight_scale.weight_loader(row.weight_scale, full)
    assert torch.equal(row.weight_scale.data, full)  # every output row lives on each rank


def test_per_tensor_shard_scales_fold_into_per_row_scales_exactly():
    method = Fp8PerTensorMethod(QuantConfig("tensor", "static"))
    layer = MergedColumnParallelLinear(64, [128, 128], TPGroup(1, 2), method=method)
    for shard, (ws, xs) in enumerate([(0.5, 0.1), (0.25, 0.3)]):
        layer.weight_scale.weight_loader(layer.weight_scale, torch.tensor(ws), shard)
        layer.input_scale.weight_loader(layer.input_scale, torch.tensor([xs]), shard)
    layer.weight.data.copy_(ops.quantize(randn(128, 64), torch.tensor(0.01)))
    process_weights_after_loading(layer)
    assert layer.weight_scale.shape == (128,)
    assert layer.weight_scale[:64].eq(0.5).all() and layer.weight_scale[64:].eq(0.25).all()
    assert layer.input_scale.item() == pytest.approx(0.3)  # the shards' max


def test_per_tensor_scale_loader_refuses_one_scale_for_a_fused_tensor():
    layer = qkv(Fp8PerTensorMethod(QuantConfig("tensor", "token")), 0)
    with pytest.raises(ValueError, match="one scale for a fused tensor"):
        layer.weight_scale.weight_loader(layer.weight_scale, torch.tensor(1.0))


def test_block_scales_slice_by_128_blocks_on_rows_and_input_columns_at_tp2():
    method = Fp8BlockMethod(QuantConfig("block", "group", (128, 128), "weight_scale_inv"))
    full = randn(2, 2).abs()  # [256 rows / 128, 256 columns / 128]
    for rank in (0, 1):
        layer = qkv(method, rank, head_dim=128, hidden=256)
        assert layer.weight_scale_inv.shape == (3, 2)  # one block row of each of q, k, v
        for shard in range(3):
            layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, full, shard)
        assert torch.equal(layer.weight_scale_inv.data, full[rank].expand(3, 2))
        row = RowParallelLinear(256, 256, TPGroup(rank, 2), method=method)
        row.weight_scale_inv.weight_loader(row.weight_scale_inv, full)
        assert torch.equal(row.weight_scale_inv.data, full[:, rank : rank + 1])


def test_a_tp_slice_that_cuts_a_128_block_is_refused_when_the_layer_is_built():
    method = Fp8BlockMethod(QuantConfig("block", "group", (128, 128), "weight_scale_inv"))
    with pytest.raises(ValueError, match=r"rows 96\.\.192 of 192 are not aligned to the 128"):
        MergedColumnParallelLinear(256, [192, 192], TPGroup(1, 2), method=method)
    with pytest.raises(ValueError, match="input columns 0..96 of 192 are not aligned"):
        RowParallelLinear(192, 256, TPGroup(0, 2), method=method)


@pytest.mark.parametrize(
    "config",
    [
        QuantConfig("tensor", "static", from_checkpoint=False),
        QuantConfig("channel", "token", from_checkpoint=False),
        QuantConfig("block", "group", (128, 128), "weight_scale_inv", from_checkpoint=False),
    ],
    ids=["tensor", "channel", "block"],
)
def test_each_fp8_method_writes_its_output_into_a_given_buffer(config):
    """What a prefill graph's qkv projection does (`LinearMethod.apply`'s `out`): the same
    values as the method's own output tensor, in the buffer, rows past it untouched."""
    from common.model.quantization.selection import FP8_METHODS

    layer = qkv(FP8_METHODS[config.weights](config), 0, head_dim=128, hidden=256)
    layer.weight.data.copy_(randn(*layer.weight.shape) * 0.05)
    process_weights_after_loading(layer)
    x = randn(6, 256)
    buffer = torch.full((8, layer.weight.shape[0]), float("nan"))
    with torch.no_grad():
        out = layer(x, buffer[:6])
        assert out.data_ptr() == buffer.data_ptr()
        assert torch.equal(buffer[:6], layer(x)) and buffer[6:].isnan().all()


def test_scaled_mm_writes_a_given_buffer_directly():
    """The per-tensor cuBLASLt call with `out` (CPU `_scaled_mm` here, the GPU in the GPU run)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    xs = torch.tensor(0.01, device=device)
    x, w = randn(8, 64).to(device), randn(48, 64).to(device)
    xq, (wq, ws) = ops.quantize_per_tensor(x, xs), ops.quantize_weight_per_tensor(w)
    expected = scaled_mm_linear(xq, xs, wq, ws, torch.bfloat16, None)
    buffer = torch.zeros(8, 48, dtype=torch.bfloat16, device=device)
    out = scaled_mm_linear(xq, xs, wq, ws, torch.bfloat16, None, buffer)
    assert out.data_ptr() == buffer.data_ptr() and torch.equal(buffer, expected)
