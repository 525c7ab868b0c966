"""Long fresh prompts' prefill through PyTorch's SDPA
(`common/model/attention/fresh_prefill.py`): which steps take it (CPU), and on a GPU that it
gives what the paged Triton kernel gives over the same written cache, through the backend."""

from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import pytest  # noqa: E402

pytest.importorskip("triton")

from common.model.attention.base import AttentionMetadata  # noqa: E402
from common.model.attention.fresh_prefill import MIN_TOKENS, takes_fresh_path  # noqa: E402

PAGE = 16
CUDA = torch.cuda.is_available()


def metadata(query_lens: list[int], ctx_lens: list[int], device) -> AttentionMetadata:
    """Sequences of `ctx_lens[i]` cached and `query_lens[i]` new tokens, pages laid out one
    sequence after another from block 0."""
    seq_lens = [q + c for q, c in zip(query_lens, ctx_lens, strict=True)]
    pages = [-(-n // PAGE) for n in seq_lens]
    width = max(pages)
    tables, slots, first = [], [], 0
    for n, ctx, q_len in zip(pages, ctx_lens, query_lens, strict=True):
        tables.append(list(range(first, first + n)) + [0] * (width - n))
        slots += [first * PAGE + p for p in range(ctx, ctx + q_len)]
        first += n
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def test_cpu_steps_keep_the_paged_kernel():
    q = torch.zeros(8, 4, 128, dtype=torch.bfloat16)
    cache = torch.zeros(2, PAGE, 2, 128, dtype=torch.bfloat16)
    assert not takes_fresh_path(q, cache, metadata([MIN_TOKENS], [0], "cpu"))


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_which_steps_take_the_fresh_path(monkeypatch):
    q = torch.zeros(8, 4, 128, dtype=torch.bfloat16, device="cuda")
    cache = torch.zeros(2, PAGE, 2, 128, dtype=torch.bfloat16, device="cuda")
    fresh = metadata([MIN_TOKENS, 3], [0, 0], "cuda")
    assert takes_fresh_path(q, cache, fresh)
    assert not takes_fresh_path(q, cache, metadata([MIN_TOKENS - 1, 3], [0, 0], "cuda"))  # short
    assert not takes_fresh_path(q, cache, metadata([MIN_TOKENS] * 9, [0] * 9, "cuda"))  # many
    assert not takes_fresh_path(q, cache, metadata([MIN_TOKENS, 3], [0, 7], "cuda"))  # a prefix
    assert takes_fresh_path(q, cache.to(torch.float8_e4m3fn), fresh)  # FP8 cache
    assert not takes_fresh_path(q.float(), cache.float(), fresh)  # fp32
    monkeypatch.setenv("PDSERVE_FRESH_PREFILL", "0")
    assert not takes_fresh_path(q, cache, fresh)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 4, 128), (8, 8, 64), (12, 2, 96)])
@pytest.mark.parametrize("fp8_cache", [False, True])
def test_fresh_path_equals_the_paged_kernel(
    monkeypatch, dtype, heads, kv_heads, head_dim, fp8_cache
):
    """Fresh path (cache of q's dtype, or FP8) against the paged kernel over a cache of q's
    dtype: both attend over the keys and values as computed."""
    from common.model.attention.triton_backend import TritonAttentionBackend

    torch.manual_seed(0)
    lens = [1, 300, MIN_TOKENS + 77]
    meta = metadata(lens, [0] * len(lens), "cuda")
    tokens = sum(lens) + 3  # three padding rows after the step's tokens
    q = torch.randn(tokens, heads, head_dim, dtype=dtype, device="cuda")
    # k and v as views of one qkv-like buffer, as the layers hand them over (strided rows)
    kv = torch.randn(tokens, 2, kv_heads, head_dim, dtype=dtype, device="cuda")
    k, v = kv[:, 0], kv[:, 1]
    pages = sum(-(-n // PAGE) for n in lens)
    scale = 0.7 / head_dim**0.5  # not SDPA's default
    slots = torch.cat([meta.slot_mapping, torch.full((3,), -1, device="cuda")])
    padded = dataclasses.replace(meta, slot_mapping=slots)
    outs = []
    for switch, cache_dtype in (("1", torch.float8_e4m3fn if fp8_cache else dtype), ("0", dtype)):
        monkeypatch.setenv("PDSERVE_FRESH_PREFILL", switch)
        k_cache = torch.zeros(pages + 1, PAGE, kv_heads, head_dim, dtype=cache_dtype, device="cuda")
        v_cache = torch.zeros_like(k_cache)
        assert takes_fresh_path(q, k_cache, meta) == (switch == "1")
        out = TritonAttentionBackend().forward(q, k, v, k_cache, v_cache, padded, scale, 0.5, 0.25)
        outs.append((out, k_cache, v_cache))
    (fresh, k1, v1), (paged, k0, v0) = outs
    # the cache is written either way (FP8: k / 0.5 and v / 0.25, rounded to e4m3)
    if fp8_cache:
        written = torch.cat([k1.flatten(0, 1)[meta.slot_mapping].float() * 0.5,
                             v1.flatten(0, 1)[meta.slot_mapping].float() * 0.25])  # fmt: skip
        fresh_kv = torch.cat([k[: sum(lens)], v[: sum(lens)]]).float()
        assert (written - fresh_kv).abs().max().item() <= 0.07 * fresh_kv.abs().max().item()
    else:
        assert torch.equal(k1, k0) and torch.equal(v1, v0)
    assert torch.count_nonzero(fresh[sum(lens) :]) == 0
    err = (fresh.float() - paged.float()).abs().max().item()
    assert err <= 2e-2 * paged.float().abs().max().item(), err
