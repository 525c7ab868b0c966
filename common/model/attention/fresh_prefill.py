"""Prefill of long fresh prompts through PyTorch's fused attention (SDPA; cuDNN's on an H200).

A prefill step whose sequences all start at position 0 (no cached prefix, no earlier chunk)
attends only over its own new tokens, and those are at hand as the projections computed them.
For long prompts SDPA's fused kernel does that faster than our paged Triton kernel, which reads
the same keys back through the block table. On one H200 (32 query and 4 KV heads of 128;
`bench_attention.py`, `docs/benchmarks.md`, FP8 section, sixth round): 8192 tokens took 0.95-0.97
ms a layer against 1.50-1.54 ms (1.40 with the best tiles of a sweep), 2048 tokens 0.12 against
0.14-0.17 ms. The step's KV is still written to the cache first: decode and later chunks read
it there.

It runs one SDPA call per sequence, on [1, heads, n, d] views of the step's rows (no copies;
GQA through `enable_gqa`, no repeated K/V heads); with torch 2.11 on the H200, SDPA picks cuDNN's
attention for these shapes. torch's varlen entry point (`torch.nn.attention.varlen.varlen_attn`,
FlashAttention-2) would take the whole step in one call, but it ran the same 8k layer in 1.78
ms. Attention runs eagerly in prefill graphs too (`common/engine/prefill_graphs.py`), so the
choice is made per step.

Which steps take it (`takes_fresh_path`): CUDA; a bf16 or fp16 q, and a cache of q's dtype or
FP8; head_dim <= 256; every sequence fresh (`seq_lens_cpu == query_lens_cpu`); at most
`MAX_SEQUENCES` of them, the longest at least `MIN_TOKENS` long. Steps with any cached context
(prefix-cache hits, later chunks, decode rows) keep the paged kernel. PDSERVE_FRESH_PREFILL=0
turns the path off (A/B runs).

With an FP8 cache a fresh prompt thus attends over its keys and values as computed, before
their e4m3 rounding (as SGLang's extend without a prefix does); every later read (decode,
later chunks, prefix hits) reads the rounded cache. So a prompt's prefill logits no longer see
the cache's rounding, and a prompt prefilled in chunks differs slightly from one prefilled
whole. `benchmarks/perplexity.py` reads K and V back from the cache in every window, the
rounding that decode sees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common import envs
from common.model.attention.base import AttentionMetadata

MAX_HEAD_DIM = 256  # beyond it SDPA has no fused kernel and would fall back to its math path
MIN_TOKENS = 2048  # the longest prompt of the step; at 1024 tokens the kernels were even
MAX_SEQUENCES = 8  # one SDPA launch each, per layer


def takes_fresh_path(q: torch.Tensor, k_cache: torch.Tensor, metadata: AttentionMetadata) -> bool:
    """Whether `fresh_prefill` runs this step (module docstring)."""
    return (
        q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
        and q.shape[-1] <= MAX_HEAD_DIM
        and metadata.max_query_len >= MIN_TOKENS
        and metadata.num_seqs <= MAX_SEQUENCES
        and metadata.seq_lens_cpu == metadata.query_lens_cpu
        and envs.fresh_prefill()
    )


def fresh_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of each fresh sequence over its own tokens: q [T, heads, d], k and v
    [T, kv_heads, d] (rows past the step's tokens are padding) -> [T, heads, d], padding rows
    zeroed."""
    gqa = q.shape[1] != k.shape[1]
    outs, start = [], 0
    for n in metadata.query_lens_cpu:
        rows = slice(start, start + n)
        o = F.scaled_dot_product_attention(
            *(t[rows].transpose(0, 1)[None] for t in (q, k, v)),
            is_causal=True, scale=scale, enable_gqa=gqa,
        )  # fmt: skip
        outs.append(o[0].transpose(0, 1))  # [n, heads, d]
        start += n
    if len(outs) == 1 and start == q.shape[0]:
        return outs[0]
    out = torch.empty_like(q)
    start = 0
    for o in outs:
        out[start : start + o.shape[0]] = o
        start += o.shape[0]
    out[start:] = 0
    return out
