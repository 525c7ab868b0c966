"""The flash_attn backend against the torch reference (needs CUDA and the flash_attn package;
skipped, and said so, where either is absent)."""

from __future__ import annotations

import pytest
import torch

from common.model.attention.flash_attn_backend import (
    REQUIRED_BLOCK_SIZE_MULTIPLE,
    check_block_size,
    flash_attn_available,
)


def test_block_size_check_names_the_required_multiple():
    check_block_size(REQUIRED_BLOCK_SIZE_MULTIPLE)
    with pytest.raises(ValueError, match=str(REQUIRED_BLOCK_SIZE_MULTIPLE)):
        check_block_size(16)


@pytest.mark.skipif(not flash_attn_available(), reason="flash_attn package or CUDA not available")
@pytest.mark.parametrize("decode", [False, True])
def test_flash_attn_matches_torch_reference_on_paged_cache(decode):
    from common.model.attention.base import AttentionMetadata
    from common.model.attention.flash_attn_backend import FlashAttnBackend
    from common.model.attention.torch_backend import TorchAttentionBackend

    torch.manual_seed(0)
    dev, dt, bs, h, hk, d = "cuda", torch.bfloat16, 256, 8, 2, 128
    ctx_lens = [300, 17, 600]
    q_lens = [1, 1, 1] if decode else [40, 17, 5]
    blocks_per = [-(-n // bs) for n in ctx_lens]
    tables, nxt = [], 0
    for n in blocks_per:
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    width = max(blocks_per)
    k_cache = torch.randn(nxt, bs, hk, d, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    slots = [
        t[p // bs] * bs + p % bs
        for t, c, ql in zip(tables, ctx_lens, q_lens, strict=True)
        for p in range(c - ql, c)
    ]
    total = sum(q_lens)
    cum = [0]
    for n in q_lens:
        cum.append(cum[-1] + n)
    md = AttentionMetadata(
        query_start_loc=torch.tensor(cum, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev
        ),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        query_lens_cpu=q_lens,
        seq_lens_cpu=ctx_lens,
        max_query_len=max(q_lens),
        max_seq_len=max(ctx_lens),
    )
    q, k, v = (torch.randn(total, n, d, device=dev, dtype=dt) for n in (h, hk, hk))
    ref = TorchAttentionBackend().forward(q, k, v, k_cache.clone(), v_cache.clone(), md, d**-0.5)
    out = FlashAttnBackend().forward(q, k, v, k_cache, v_cache, md, d**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_every_backend_auto_can_choose_is_registered():
    from common.model.attention import BACKENDS

    assert {"torch", "triton", "flash_attn"} <= set(BACKENDS)


@pytest.mark.skipif(flash_attn_available(), reason="flash_attn is installed here")
def test_requesting_flash_attn_without_the_package_is_a_clear_error():
    from common.model.attention.selection import choose_backend

    with pytest.raises(ValueError, match="flash_attn package"):
        choose_backend("flash_attn", torch.device("cpu"), 256)
