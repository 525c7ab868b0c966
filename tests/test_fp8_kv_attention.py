"""FP8 (e4m3) KV caches: the KV write, every attention path and block copies against the
quantization contract of `fp8_ops.quantize` and attention over the dequantized cache in fp32.

Without CUDA the Triton kernels run in the CPU interpreter (TRITON_INTERPRET must be set before
the kernels are decorated, hence before the imports below).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from common.model.attention.base import AttentionMetadata, ForwardContext  # noqa: E402
from common.model.attention.selection import choose_backend  # noqa: E402
from common.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from common.model.attention.torch_backend import write_kv as torch_write_kv  # noqa: E402
from common.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from common.model.kernels import fused_ops  # noqa: E402
from common.model.kernels.block_copy import BlockCopier, block_pairs  # noqa: E402
from common.model.kernels.paged_attention import (  # noqa: E402
    DecodeScratch,
    paged_decode_attention,
    paged_prefill_attention,
)
from common.model.quantization.fp8_ops import FP8, quantize  # noqa: E402

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
K_SCALE, V_SCALE = 0.05, 0.02
# Triton and torch read the same FP8 bytes; they differ only in summation order, and with a
# bf16 query in the P cast to bf16 before P V (the output is bf16 anyway).
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def fp8_batch(q_lens, seq_lens, heads, kv_heads, head_dim, dtype, page=16):
    """Random FP8 context in scattered pages (quantized with K_SCALE / V_SCALE) and one
    step's new q/k/v of `dtype`, as a backend receives them."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-s // page) for s in seq_lens) + 2
    shape = (num_blocks, page, kv_heads, head_dim)
    k_cache = quantize(torch.randn(shape, generator=gen) * 3, torch.tensor(K_SCALE)).to(DEVICE)
    v_cache = quantize(torch.randn(shape, generator=gen), torch.tensor(V_SCALE)).to(DEVICE)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-s // page))] for s in seq_lens]
    width = max(len(t) for t in tables)
    slots = [
        t[p // page] * page + p % page
        for t, n, s in zip(tables, q_lens, seq_lens, strict=True)
        for p in range(s - n, s)
    ]
    cum = torch.tensor([0, *q_lens]).cumsum(0)

    def tensor(values, dt):
        return torch.as_tensor(values, dtype=dt, device=DEVICE)

    md = AttentionMetadata(
        query_start_loc=tensor(cum, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        block_tables=tensor([t + [0] * (width - len(t)) for t in tables], torch.int32),
        slot_mapping=tensor(slots, torch.int64),
        query_lens_cpu=list(q_lens),
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    t = sum(q_lens)
    q = torch.randn(t, heads, head_dim, generator=gen).to(DEVICE, dtype)
    k = (torch.randn(t, kv_heads, head_dim, generator=gen) * 3).to(DEVICE, dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    return q, k, v, k_cache, v_cache, md


def dequantized_attention(q, k_cache, v_cache, md, scale):
    """fp32 causal attention of each sequence's new rows over `stored.float() * scale` of its
    pages: the definition the FP8 paths must meet."""
    page, outs = k_cache.shape[1], []
    for i, (n, s) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu, strict=True)):
        pos = torch.arange(s, device=q.device)
        slots = md.block_tables[i].long()[pos // page] * page + pos % page
        keys = k_cache.flatten(0, 1)[slots].float() * K_SCALE  # [s, kv_heads, d]
        values = v_cache.flatten(0, 1)[slots].float() * V_SCALE
        group = q.shape[1] // k_cache.shape[2]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        start = int(md.query_start_loc[i])
        rows = q[start : start + n].float()
        scores = torch.einsum("qhd,khd->hqk", rows, keys) * scale
        visible = pos[None, :] <= torch.arange(s - n, s, device=q.device)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, values))
    return torch.cat(outs)


def e4m3_probe_values() -> torch.Tensor:
    """Every finite e4m3 value, every midpoint between neighbours (the ties) and the floats
    just either side of each, values past +-448, infinities and signed zeros."""
    codes = torch.arange(256, dtype=torch.uint8)
    grid = codes[(codes & 0x7F) != 0x7F].view(FP8).float().unique()
    mids = (grid[1:] + grid[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    edges = torch.tensor([500.0, -464.0, 1e6, float("inf"), float("-inf"), -0.0, 1e-12, -1e-12])
    return torch.cat([grid, mids, mids.nextafter(up), mids.nextafter(down), edges])


@pytest.mark.parametrize("writer", ["triton", "torch"])
@pytest.mark.parametrize("scale", [1.0, 0.0371])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_into_fp8_equals_the_reference_quantization_bit_for_bit(writer, scale, dtype):
    x = (e4m3_probe_values() * scale).to(dtype)
    x = torch.cat([x, torch.randn(-x.numel() % 8).to(dtype)]).view(-1, 2, 4).to(DEVICE)
    k_cache = torch.zeros(x.shape[0] // 8 + 1, 8, 2, 4, dtype=FP8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(k_cache.shape[0] * 8)[: x.shape[0]].to(DEVICE)
    write = fused_ops.write_kv if writer == "triton" else torch_write_kv
    write(x, -x, k_cache, v_cache, slots, scale, 2 * scale)
    divisor = torch.tensor(scale, device=DEVICE)
    assert torch.equal(as_bytes(k_cache.flatten(0, 1)[slots]), as_bytes(quantize(x, divisor)))
    assert torch.equal(as_bytes(v_cache.flatten(0, 1)[slots]), as_bytes(quantize(-x, 2 * divisor)))
    stored = torch.cat([k_cache, v_cache]).float()
    assert stored.isfinite().all() and stored.abs().max() == 448.0  # saturated, never inf/NaN


def test_write_kv_into_fp8_refuses_a_non_positive_scale():
    k = torch.randn(1, 1, 4, device=DEVICE)
    cache = torch.zeros(1, 4, 1, 4, dtype=FP8, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    for write in (fused_ops.write_kv, torch_write_kv):
        with pytest.raises(ValueError, match="positive"):
            write(k, k, cache, cache.clone(), slots, 0.0, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_on_fp8_is_sdpa_over_the_dequantized_cache(dtype):
    q, k, v, kc, vc, md = fp8_batch([1, 6, 5], [9, 6, 40], 4, 2, 32, dtype)
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, md, 0.2, K_SCALE, V_SCALE)
    ref = dequantized_attention(q, kc, vc, md, 0.2)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


# Chunked prefill after cached context (seq_len > query_len), whole prompts, a decode row in a
# mixed batch; GQA group 2 and 4; pages of 8 and 16 against key tiles of 16 and 64.
PREFILL_CASES = [
    (torch.float32, 4, 2, 64, 16, None),
    (torch.bfloat16, 4, 2, 64, 16, None),
    (torch.float32, 8, 2, 32, 8, 16),
    (torch.bfloat16, 4, 1, 32, 8, 16),
]


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim,page,block_n", PREFILL_CASES)
def test_triton_prefill_on_fp8_matches_torch_and_dequantized_fp32(
    dtype, heads, kv_heads, head_dim, page, block_n
):
    q_lens, seq_lens = [1, 17, 5, 30], [1, 17, 33, 70]
    q, k, v, kc, vc, md = fp8_batch(q_lens, seq_lens, heads, kv_heads, head_dim, dtype, page)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref = TorchAttentionBackend().forward(q, k, v, ref_kc, ref_vc, md, 0.125, K_SCALE, V_SCALE)
    fused_ops.write_kv(k, v, kc, vc, md.slot_mapping, K_SCALE, V_SCALE)
    assert torch.equal(as_bytes(kc), as_bytes(ref_kc)) and torch.equal(
        as_bytes(vc), as_bytes(ref_vc)
    )
    out = torch.empty_like(q)
    paged_prefill_attention(
        q, kc, vc, out, md.query_start_loc, md.seq_lens, md.block_tables, md.max_query_len,
        0.125, block_n, k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    exact = dequantized_attention(q, kc, vc, md, 0.125)
    torch.testing.assert_close(out.float(), exact, **TOL[dtype])


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_on_fp8_matches_torch_and_dequantized_fp32(splits, dtype):
    seq_lens = [1, 16, 33, 150]
    q, k, v, kc, vc, md = fp8_batch([1] * 4, seq_lens, 8, 2, 64, dtype, page=16)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref = TorchAttentionBackend().forward(q, k, v, ref_kc, ref_vc, md, 0.125, K_SCALE, V_SCALE)
    fused_ops.write_kv(k, v, kc, vc, md.slot_mapping, K_SCALE, V_SCALE)
    out = torch.full_like(q, float("nan"))
    scratch = None if splits == 1 else DecodeScratch.allocate(4, 8, splits, 64, q.device)
    paged_decode_attention(
        q, kc, vc, out, md.seq_lens, md.block_tables, 0.125, scratch, 32,
        k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    torch.testing.assert_close(
        out.float(), dequantized_attention(q, kc, vc, md, 0.125), **TOL[dtype]
    )


@pytest.mark.parametrize("fp16_products", [True, False])
def test_a_bf16_query_on_fp8_meets_the_dequantized_fp32_in_either_product_dtype(fp16_products):
    """bf16 q runs the products in fp16 by default (hardware e4m3 -> fp16); bf16 products are
    the other way, kept for benchmarks. Both meet the same fp32 definition."""
    seq_lens, q_lens = [1, 16, 33, 150], [1, 17, 5, 30]
    q, k, v, kc, vc, md = fp8_batch([1] * 4, seq_lens, 8, 2, 64, torch.bfloat16)
    fused_ops.write_kv(k, v, kc, vc, md.slot_mapping, K_SCALE, V_SCALE)
    out = torch.full_like(q, float("nan"))
    scratch = DecodeScratch.allocate(4, 8, 4, 64, q.device)
    paged_decode_attention(
        q, kc, vc, out, md.seq_lens, md.block_tables, 0.125, scratch, 32,
        k_scale=K_SCALE, v_scale=V_SCALE, fp16_products=fp16_products,
    )  # fmt: skip
    exact = dequantized_attention(q, kc, vc, md, 0.125)
    torch.testing.assert_close(out.float(), exact, **TOL[torch.bfloat16])
    q, k, v, kc, vc, md = fp8_batch(q_lens, [1, 17, 33, 70], 4, 2, 64, torch.bfloat16)
    fused_ops.write_kv(k, v, kc, vc, md.slot_mapping, K_SCALE, V_SCALE)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(
        q, kc, vc, out, md.query_start_loc, md.seq_lens, md.block_tables, md.max_query_len,
        0.125, k_scale=K_SCALE, v_scale=V_SCALE, fp16_products=fp16_products,
    )  # fmt: skip
    exact = dequantized_attention(q, kc, vc, md, 0.125)
    torch.testing.assert_close(out.float(), exact, **TOL[torch.bfloat16])


def test_a_bf16_query_beyond_the_fp16_range_is_clamped_not_turned_into_nan():
    q, k, v, kc, vc, md = fp8_batch([1, 1], [20, 40], 4, 2, 32, torch.bfloat16)
    fused_ops.write_kv(k, v, kc, vc, md.slot_mapping, K_SCALE, V_SCALE)
    q[:, 0, 0] = 1e6  # bf16 holds it, fp16 would make it inf
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(
        q, kc, vc, out, md.seq_lens, md.block_tables, 1e-6, None, k_scale=K_SCALE,
        v_scale=V_SCALE,
    )  # fmt: skip
    clamped = q.float().clamp(-65504, 65504)
    exact = dequantized_attention(clamped, kc, vc, md, 1e-6)
    assert out.isfinite().all()
    torch.testing.assert_close(out.float(), exact, **TOL[torch.bfloat16])


def test_forward_context_hands_each_layer_its_scales_to_the_triton_backend():
    q, k, v, kc, vc, md = fp8_batch([1, 1], [20, 300], 4, 2, 32, torch.float32)
    caches = [(kc.clone(), vc.clone()) for _ in range(2)]
    ctx = ForwardContext(
        TritonAttentionBackend(), md, [c[0] for c in caches], [c[1] for c in caches], 0.2,
        k_scales=[1.0, K_SCALE], v_scales=[1.0, V_SCALE],
    )  # fmt: skip
    out = ctx.attention(1, q, k, v)
    ref = TorchAttentionBackend().forward(q, k, v, kc, vc, md, 0.2, K_SCALE, V_SCALE)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    assert torch.equal(as_bytes(caches[1][0]), as_bytes(kc))
    with pytest.raises(ValueError, match="v_scales has 1 entries for 2 layers"):
        ForwardContext(TritonAttentionBackend(), md, [kc, kc], [vc, vc], 0.2, v_scales=[1.0])


def test_block_copies_of_an_fp8_pool_are_bit_exact():
    codes = torch.randint(0, 256, (3, 2, 5, 16, 2, 24), dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes: values a real pool holds
    src = codes.view(FP8).to(DEVICE)
    dst = torch.zeros(3, 2, 7, 16, 2, 24, dtype=FP8, device=DEVICE)
    want = as_bytes(dst).clone()
    for s, d in ((4, 6), (0, 1), (2, 2)):
        want[1:3, :, d] = as_bytes(src)[1:3, :, s]
    BlockCopier(src, dst)(block_pairs([4, 0, 2], [6, 1, 2]).to(DEVICE), range(1, 3))
    assert torch.equal(as_bytes(dst), want)


def test_flash_attn_refuses_an_fp8_cache_and_auto_picks_triton_for_it():
    with pytest.raises(ValueError, match=r"flash_attn.*float8_e4m3fn"):
        choose_backend("flash_attn", torch.device("cuda"), 256, kv_dtype=FP8)
    name, why = choose_backend("auto", torch.device("cuda"), 256, kv_dtype=FP8)
    assert name == "triton" and "FP8" in why
    assert choose_backend("triton", torch.device("cuda"), 16, kv_dtype=FP8)[0] == "triton"
