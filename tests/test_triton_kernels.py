"""Triton kernels and the triton backend against the torch reference.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET must be set before
the kernels are decorated, hence before any import below). With CUDA they run compiled on the
GPU; set TRITON_INTERPRET=1 yourself to interpret there too.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from common.model import ops  # noqa: E402
from common.model.attention import create_backend  # noqa: E402
from common.model.attention.base import AttentionMetadata  # noqa: E402
from common.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from common.model.attention.torch_backend import write_kv as torch_write_kv  # noqa: E402
from common.model.kernels import fused_ops  # noqa: E402
from common.model.kernels.block_copy import BlockCopier, block_pairs  # noqa: E402
from common.model.kernels.paged_attention import (  # noqa: E402
    DecodeScratch,
    decode_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = ["cpu"] if INTERPRET else ["cuda"]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# bf16: a rounding step apart at most (the interpreter truncates fp32 -> bf16, GPUs round).
ELEMENTWISE_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    torch.manual_seed(0)
    return torch.device(request.param)


def make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, device, page=16):
    """A paged cache full of random context and one step's new q/k/v (scattered pages)."""
    num_blocks = sum(-(-s // page) for s in seq_lens) + 3
    k_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_blocks).tolist()
    tables = []
    for s in seq_lens:
        tables.append([order.pop() for _ in range(-(-s // page))])
    width = max(1, max(len(t) for t in tables))
    slots = [
        t[p // page] * page + p % page
        for t, q_len, s in zip(tables, q_lens, seq_lens, strict=True)
        for p in range(s - q_len, s)
    ]
    cum = [0]
    for n in q_lens:
        cum.append(cum[-1] + n)

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    metadata = AttentionMetadata(
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
    q = torch.randn(t, num_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(t, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    return q, k, v, k_cache, v_cache, metadata


# (num_heads, num_kv_heads, head_dim, dtype): GQA ratios 1, 2, 4 and MQA, both head dims.
ATTENTION_CASES = [
    (4, 4, 64, torch.float32),
    (4, 2, 128, torch.bfloat16),
    (8, 2, 64, torch.float32),
    (4, 1, 128, torch.float32),
    (4, 1, 64, torch.bfloat16),
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype", ATTENTION_CASES)
def test_prefill_with_cached_prefix_and_chunks_matches_torch(
    device, heads, kv_heads, head_dim, dtype
):
    # Whole prompts around the page boundary, chunks after a cached prefix, a decode row
    # (mixed batch) and one chunk long enough for several query and key tiles.
    q_lens = [1, 15, 16, 17, 5, 16, 1, 70]
    seq_lens = [1, 15, 16, 17, 33, 33, 17, 90]
    q, k, v, kc, vc, md = make_batch(q_lens, seq_lens, heads, kv_heads, head_dim, dtype, device)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref = TorchAttentionBackend().forward(q, k, v, ref_kc, ref_vc, md, head_dim**-0.5)
    out = create_backend("triton").forward(q, k, v, kc, vc, md, head_dim**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)


@pytest.mark.parametrize("page,block_n", [(16, 16), (8, 32), (32, 16)])
def test_prefill_kernel_tiles_independent_of_page_size(device, page, block_n):
    q_lens, seq_lens = [9, 40, 1], [9, 75, 50]
    q, k, v, kc, vc, md = make_batch(q_lens, seq_lens, 4, 2, 64, torch.float32, device, page)
    torch_write_kv(k, v, kc, vc, md.slot_mapping)
    ref = TorchAttentionBackend().forward(q, k, v, kc.clone(), vc.clone(), md, 0.125)
    out = torch.full_like(q, float("nan"))  # every row must be written
    paged_prefill_attention(
        q, kc, vc, out, md.query_start_loc, md.seq_lens, md.block_tables, 40, 0.125, block_n
    )
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_prefill_zeroes_padding_tokens_after_the_last_sequence(device):
    q, k, v, kc, vc, md = make_batch([3, 4], [3, 20], 4, 2, 64, torch.float32, device)
    pad = torch.full((2, 4, 64), float("nan"), device=device)
    q = torch.cat([q, pad])
    k, v = torch.cat([k, pad[:, :2]]), torch.cat([v, pad[:, :2]])
    md.slot_mapping = torch.cat([md.slot_mapping, torch.full((2,), -1, device=device)])
    out = create_backend("triton").forward(q, k, v, kc, vc, md, 0.125)
    assert torch.equal(out[7:], torch.zeros_like(out[7:]))
    assert not out.isnan().any()


@pytest.mark.parametrize("head_dim", [16, 96, 256])
def test_other_head_dims_prefill_and_decode(device, head_dim):
    """Powers of two up to 256, and a non-power of two (masked to the next one)."""
    backend = create_backend("triton")
    for q_lens, seq_lens in (([5, 1], [21, 40]), ([1, 1], [21, 40])):
        q, k, v, kc, vc, md = make_batch(q_lens, seq_lens, 4, 2, head_dim, torch.float32, device)
        ref = TorchAttentionBackend().forward(q, k, v, kc.clone(), vc.clone(), md, 0.1)
        torch.testing.assert_close(
            backend.forward(q, k, v, kc, vc, md, 0.1), ref, **TOL[torch.float32]
        )


def _decode_reference(q, k, v, kc, vc, md, scale, live):
    """The torch backend on the live rows only (it has no notion of empty padding rows)."""
    idx = torch.tensor(live, device=q.device)
    sub = AttentionMetadata(
        query_start_loc=torch.arange(len(live) + 1, dtype=torch.int32, device=q.device),
        seq_lens=md.seq_lens[idx],
        block_tables=md.block_tables[idx],
        slot_mapping=md.slot_mapping[idx],
        query_lens_cpu=[1] * len(live),
        seq_lens_cpu=[md.seq_lens_cpu[i] for i in live],
        max_query_len=1,
        max_seq_len=max(md.seq_lens_cpu[i] for i in live),
    )
    return TorchAttentionBackend().forward(q[idx], k[idx], v[idx], kc, vc, sub, scale)


def _with_padding_row(md: AttentionMetadata, row: int) -> None:
    """Turn `row` into a captured batch's padding row: length 0, KV not written."""
    md.seq_lens[row] = 0
    md.slot_mapping[row] = -1
    md.seq_lens_cpu[row] = 0


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype", ATTENTION_CASES)
def test_decode_matches_torch_with_an_empty_padding_row(device, heads, kv_heads, head_dim, dtype):
    seq_lens = [1, 15, 16, 17, 33, 1, 100]
    q, k, v, kc, vc, md = make_batch([1] * 7, seq_lens, heads, kv_heads, head_dim, dtype, device)
    _with_padding_row(md, 5)
    live = [0, 1, 2, 3, 4, 6]
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref = _decode_reference(q, k, v, ref_kc, ref_vc, md, head_dim**-0.5, live)
    md.max_seq_len = 4096  # an upper bound only, as under CUDA graphs: forces several splits
    out = create_backend("triton").forward(q, k, v, kc, vc, md, head_dim**-0.5)
    torch.testing.assert_close(out[live].float(), ref.float(), **TOL[dtype])
    assert torch.equal(out[5], torch.zeros_like(out[5]))
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)


@pytest.mark.parametrize("splits", [1, 2, 8])
def test_decode_splits_agree_and_write_every_row(device, splits):
    seq_lens = [33, 1, 100, 16]
    q, k, v, kc, vc, md = make_batch([1] * 4, seq_lens, 8, 2, 64, torch.float32, device)
    _with_padding_row(md, 1)
    torch_write_kv(k[[0, 2, 3]], v[[0, 2, 3]], kc, vc, md.slot_mapping[[0, 2, 3]])
    ref = _decode_reference(q, k, v, kc.clone(), vc.clone(), md, 0.125, [0, 2, 3])
    out = torch.full_like(q, float("nan"))
    scratch = None if splits == 1 else DecodeScratch.allocate(4, 8, splits, 64, q.device)
    if scratch is not None:
        for t in (scratch.max_log2, scratch.sum_exp, scratch.acc):
            t.fill_(float("nan"))
    paged_decode_attention(q, kc, vc, out, md.seq_lens, md.block_tables, 0.125, scratch, 16)
    torch.testing.assert_close(out[[0, 2, 3]], ref, **TOL[torch.float32])
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_decode_replay_with_new_lengths_in_the_same_buffers(device):
    """What a CUDA-graph replay does: same tensors, new values, stale host-side lengths."""
    backend = create_backend("triton")
    q, k, v, kc, vc, md = make_batch([1] * 3, [20, 40, 60], 4, 2, 64, torch.float32, device)
    md.max_seq_len = 1024
    backend.forward(q, k, v, kc, vc, md, 0.125)
    scratch = dict(backend._scratch)
    assert scratch, "expected a split decode at max_seq_len 1024"

    # Next step: sequence 0 grew by 17 tokens (a new page), 1 shrank (another request took
    # the row), 2 became padding. Only device tensors change; the host lists stay stale.
    new_lens = [37, 5, 0]
    md.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    md.block_tables[0, 2] = md.block_tables[2, 0]
    md.slot_mapping.copy_(
        torch.tensor([int(md.block_tables[0, 2]) * 16 + 4, int(md.block_tables[1, 0]) * 16 + 4, -1])
    )
    q2, k2, v2 = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    md_ref = AttentionMetadata(
        md.query_start_loc, md.seq_lens.clone(), md.block_tables.clone(), md.slot_mapping.clone(),
        [1, 1, 1], new_lens, 1, max(new_lens),
    )  # fmt: skip
    ref = _decode_reference(q2, k2, v2, ref_kc, ref_vc, md_ref, 0.125, [0, 1])
    out = backend.forward(q2, k2, v2, kc, vc, md, 0.125)
    torch.testing.assert_close(out[:2], ref, **TOL[torch.float32])
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert backend._scratch == scratch  # replay allocated nothing new


def test_decode_split_count_depends_only_on_shapes_and_the_length_bound():
    cpu = torch.device("cpu")
    assert decode_num_splits(128, 4, 1024, cpu) == 1  # 512 programs fill the GPU already
    assert decode_num_splits(32, 4, 1024, cpu) == 2
    assert decode_num_splits(1, 8, 100, cpu) == 1  # too short to split
    assert decode_num_splits(1, 4, 32768, cpu) == 64
    assert all(
        (s & (s - 1)) == 0 for n in range(1, 40) for s in [decode_num_splits(n, 2, 5000, cpu)]
    )


def test_write_kv_skips_negative_slots(device):
    k_cache = torch.randn(4, 16, 2, 64, device=device)
    v_cache = torch.randn_like(k_cache)
    k, v = torch.randn(5, 2, 64, device=device), torch.randn(5, 2, 64, device=device)
    slots = torch.tensor([3, -1, 17, 63, -1], device=device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    torch_write_kv(k[keep], v[keep], ref_k, ref_v, slots[keep])
    fused_ops.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_write_kv_casts_into_a_bf16_cache_from_strided_rows(device):
    # fp32 values that bf16 holds exactly (the interpreter truncates where GPUs round);
    # k and v interleaved, so both are strided views.
    kv = torch.randn(3, 2, 2, 64, device=device).bfloat16().float()
    k_cache = torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16, device=device)
    v_cache = torch.zeros_like(k_cache)
    fused_ops.write_kv(
        kv[:, 0], kv[:, 1], k_cache, v_cache, torch.tensor([0, 5, 31], device=device)
    )
    assert torch.equal(k_cache.view(-1, 2, 64)[[0, 5, 31]], kv[:, 0].bfloat16())
    assert torch.equal(v_cache.view(-1, 2, 64)[[0, 5, 31]], kv[:, 1].bfloat16())


def _cpu(*tensors):
    return [t.cpu() for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_residual_matches_torch(device, dtype):
    x = torch.randn(5, 96, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    weight = (1 + 0.1 * torch.randn(96, device=device)).to(dtype)
    tol = ELEMENTWISE_TOL[dtype]
    out = fused_ops.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out.cpu(), ops.rms_norm(*_cpu(x, weight), 1e-6), **tol)
    out, new_residual = fused_ops.rms_norm(x, weight, 1e-6, residual)
    ref, ref_residual = ops.rms_norm(*_cpu(x, weight), 1e-6, residual.cpu())
    torch.testing.assert_close(out.cpu(), ref, **tol)
    torch.testing.assert_close(new_residual.cpu(), ref_residual, **tol)


def test_rms_norm_per_head_on_a_strided_view(device):
    qkv = torch.randn(3, 6, 32, device=device)  # q/k norm: heads of a fused projection
    q = qkv[:, :4]
    weight = torch.randn(32, device=device)
    ref = ops.rms_norm(q.cpu(), weight.cpu(), 1e-5)
    torch.testing.assert_close(fused_ops.rms_norm(q, weight, 1e-5).cpu(), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch(device, dtype):
    x = torch.randn(4, 2 * 80, dtype=dtype, device=device)
    tol = ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(fused_ops.silu_and_mul(x).cpu(), ops.silu_and_mul(x.cpu()), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rotates_q_and_k_in_place_like_torch(device, dtype):
    from common.model.layers.basic import RotaryEmbedding
    from common.model.spec import RopeSpec

    rope = RotaryEmbedding(64, 50, RopeSpec(theta=10000.0)).to(device)
    qkv = torch.randn(5, 4 + 2 + 2, 64, dtype=dtype, device=device)  # q, k, v heads side by side
    q, k, v_before = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:].clone()
    positions = torch.tensor([0, 1, 7, 33, 49], device=device)
    ref_q, ref_k = ops.apply_rotary(*_cpu(q, k, positions, rope.cos, rope.sin))
    out_q, out_k = fused_ops.apply_rotary(q, k, positions, rope.cos, rope.sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    tol = ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(qkv[:, :4].cpu(), ref_q, **tol)
    torch.testing.assert_close(qkv[:, 4:6].cpu(), ref_k, **tol)
    assert torch.equal(qkv[:, 6:], v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_with_qk_norm_normalises_each_head_first_like_torch(device, dtype):
    """Qwen3's q_norm and k_norm fused into the rotary launch: each head RMS-normalised with
    its own weights, then rotated, in place, as the separate torch ops do."""
    from common.model.layers.basic import RotaryEmbedding
    from common.model.spec import RopeSpec

    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 50, RopeSpec(theta=10000.0)).to(device)
    qkv = torch.randn(5, 4 + 2 + 2, 64, dtype=dtype, device=device) * 3
    q, k, v_before = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:].clone()
    q_w = torch.rand(64, dtype=dtype, device=device) + 0.5
    k_w = torch.rand(64, dtype=dtype, device=device) + 0.5
    positions = torch.tensor([0, 1, 7, 33, 49], device=device)
    cq, ck, cpos, ccos, csin, cqw, ckw = _cpu(q, k, positions, rope.cos, rope.sin, q_w, k_w)
    ref_q, ref_k = ops.apply_rotary(
        ops.rms_norm(cq, cqw, 1e-6), ops.rms_norm(ck, ckw, 1e-6), cpos, ccos, csin
    )
    out_q, out_k = fused_ops.apply_rotary(q, k, positions, rope.cos, rope.sin, (q_w, k_w, 1e-6))
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    tol = ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(qkv[:, :4].cpu(), ref_q, **tol)
    torch.testing.assert_close(qkv[:, 4:6].cpu(), ref_k, **tol)
    assert torch.equal(qkv[:, 6:], v_before)
    with pytest.raises(ValueError, match="qk_norm weights"):
        fused_ops.apply_rotary(q, k, positions, rope.cos, rope.sin, (q_w[:32], k_w, 1e-6))


@pytest.mark.parametrize(
    "dtype, block_shape", [(torch.bfloat16, (16, 2, 64)), (torch.float32, (4, 3, 40))]
)
@pytest.mark.parametrize("layers", [range(0, 3), range(1, 2), range(2, 3)])
def test_block_copier_writes_exactly_the_listed_blocks_of_the_listed_layers(
    device, dtype, block_shape, layers
):
    # Pools of different block counts; a block shape that is not a power of two (the masked
    # tail) and one larger than a chunk would be for small blocks.
    src = torch.randn(3, 2, 9, *block_shape, device=device).to(dtype)
    dst = torch.randn(3, 2, 12, *block_shape, device=device).to(dtype)
    src_ids, dst_ids = [7, 0, 3, 8], [11, 2, 3, 0]
    want = dst.clone()
    for s, d in zip(src_ids, dst_ids, strict=True):
        want[layers.start : layers.stop, :, d] = src[layers.start : layers.stop, :, s]
    BlockCopier(src, dst)(block_pairs(src_ids, dst_ids).to(device), layers)
    assert torch.equal(dst, want)


def test_block_copier_refuses_mismatched_pools_and_does_nothing_for_no_blocks(device):
    src = torch.randn(2, 2, 4, 16, 2, 8, device=device)
    with pytest.raises(ValueError, match="layouts differ"):
        BlockCopier(src, torch.randn(2, 2, 4, 16, 2, 4, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        BlockCopier(src, src.transpose(0, 1))
    with pytest.raises(ValueError, match="step-1 range"):
        BlockCopier(src, src.clone())(block_pairs([0], [0]).to(device), range(0, 3))
    with pytest.raises(ValueError, match="source blocks"):
        block_pairs([0, 1], [0])
    dst = src.clone().zero_()
    copy = BlockCopier(src, dst)
    copy(block_pairs([], []).to(device), range(2))
    copy(block_pairs([1], [2]).to(device), range(1, 1))
    assert not dst.any()
