"""MLA prefill in decompressed form, and which prefill sequences run it (`mla_prefill` mode).

Per head, with R = 2 Dc (Dn + Dv) the FLOPs of one token through kv_b_proj (262144 for
DeepSeek-V2-Lite: Dc = kv_lora_rank 512, Dr = rope 64, Dn = Dv = 128):
- absorbed (the kernels' form): 2 (Dc + Dr) + 2 Dc = 2176 per (query, visible key) pair over
  the latent rows, plus R per new token (W_UK into q, W_UV after);
- decompressed (HF's form): R per context token to rebuild its key and value
  (`LatentProjection.decompress`), then 2 (Dn + Dr) + 2 Dv = 640 per pair.
A chunk of P new tokens after C cached ones saves 1536 P (C + P / 2) and pays R C more: a fresh
prompt is cheaper decompressed at any length, a chunk behind a long prefix from P ~ R / 1536 ~
170. Decode rows, short chunks and short contexts stay absorbed (`AUTO_DECOMPRESS`).

Contract: `decompressed_sequence` runs eagerly on host lengths (shapes follow the sequence),
which the prefill graphs allow (attention runs between captured pieces). It materialises the
sequence's whole K [heads, context, Dn + Dr] and V [heads, context, Dv] in q's dtype;
`DecompressRule.max_context_rows` bounds that under "auto", forced "decompressed" does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from common.model.attention.base import AttentionMetadata, LatentProjection
from common.model.quantization.fp8_ops import FP8


@dataclass(frozen=True)
class DecompressRule:
    """Under "auto", sequence i of a prefill step runs decompressed iff its chunk has at least
    `min_query_tokens` new tokens, its context at least `min_context_tokens`, and heads x its
    context is at most `max_context_rows`."""

    min_query_tokens: int
    max_context_rows: int
    min_context_tokens: int = 0

    def decompresses(self, query_len: int, seq_len: int, heads: int) -> bool:
        return (
            query_len >= self.min_query_tokens
            and seq_len >= self.min_context_tokens
            and heads * seq_len <= self.max_context_rows
        )


# The "auto" table, from `bench_mla_prefill.py` on one H200 (DeepSeek-V2-Lite, bf16, whole
# prefill steps through the engine; docs/benchmarks.md): decompressed / absorbed time was
# x1.01 / x1.18 / x0.49 for fresh 512 / 2k / 8k prompts, and x0.81 / x0.85 / x0.45 for 512 / 2k
# / 8k new tokens behind a 4k prefix: it pays from about 4k tokens of context. 2^20 rows bound
# one sequence's K and V at ~1 GiB in bf16 (64k tokens at 16 heads).
AUTO_DECOMPRESS = DecompressRule(
    min_query_tokens=256, max_context_rows=1 << 20, min_context_tokens=4096
)

# Torch's flash kernel needs one head dim for q, k and v: padding V to q's (128 -> 192, +20%
# FLOPs) lets SDPA pick flash or cuDNN instead of the memory-efficient kernel. Measured on one
# H200 (one V2-Lite layer): padded 0.24 / 0.62 / 2.92 ms against 0.32 / 0.92 / 4.98 unpadded
# for 512 / 2k / 8k new tokens behind a 4k prefix; fresh prompts lose a little (0.75 against
# 0.66 ms at 8k). Kept on.
PAD_VALUES_ON_CUDA = True


def decompressed_sequences(
    mode: str, metadata: AttentionMetadata, heads: int, rule: DecompressRule | None = None
) -> list[int]:
    """The sequences of a prefill step that `mode` runs decompressed (the others absorbed);
    "auto" goes by `rule`, default `AUTO_DECOMPRESS`."""
    if mode == "absorbed":
        return []
    if mode == "decompressed":
        return list(range(metadata.num_seqs))
    rule = rule or AUTO_DECOMPRESS
    lens = zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)
    return [i for i, (q, s) in enumerate(lens) if rule.decompresses(q, s, heads)]


def context_rows(
    cache: torch.Tensor, block_table: torch.Tensor, length: int, kv_scale: float = 1.0
) -> torch.Tensor:
    """A sequence's first `length` cache rows [length, Dc + Dr] (an FP8 cache's as float32
    times kv_scale) from its block table row."""
    page = cache.shape[1]
    rows = cache[block_table[: -(-length // page)].long()].flatten(0, 2)[:length]
    return rows.float() * kv_scale if rows.dtype == FP8 else rows


def decompressed_sequence(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    proj: LatentProjection,
    rows: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One sequence's new tokens (q_nope [n, H, Dn], q_pe [n, H, Dr]), the last n of its
    context, whose rows `[latent | k_pe]` are `rows` [S, Dc + Dr] -> [n, H, Dv] in q's dtype."""
    keys, values = rebuild_kv(rows, proj, q_nope.dtype)
    query = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)
    return dense_causal_attention(query, keys, values, scale).transpose(0, 1)


def rebuild_kv(
    rows: torch.Tensor, proj: LatentProjection, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Context rows [S, Dc + Dr] -> K [H, S, Dn + Dr] = [latent W_UK per head | k_pe, shared by
    every head] and V [H, S, Dv] = latent W_UV, in `dtype`."""
    dc = proj.w_uk.shape[2]
    rows = rows.to(dtype)
    k_nope, values = proj.decompress(rows[:, :dc])
    keys = torch.cat((k_nope, rows[:, dc:].expand(k_nope.shape[0], -1, -1)), dim=-1)
    return keys, values


def dense_causal_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    pad_values: bool | None = None,
) -> torch.Tensor:
    """query [H, n, D] are the last n of the S keys [H, S, D]: the first S - n keys are visible
    to every query, the last n causally (bottom-right aligned). values [H, S, Dv] -> [H, n, Dv].
    `pad_values` (default `PAD_VALUES_ON_CUDA` on a GPU) pads V to D for SDPA's kernel choice."""
    n, context, dv = query.shape[1], keys.shape[1], values.shape[2]
    if pad_values is None:
        pad_values = PAD_VALUES_ON_CUDA and query.is_cuda
    if pad_values and dv < keys.shape[2]:
        values = F.pad(values, (0, keys.shape[2] - dv))
    # Imported here: torch.nn.attention.bias pulls in torch._dynamo, ~1 s of every node's start.
    from torch.nn.attention.bias import causal_lower_right

    out = F.scaled_dot_product_attention(
        query[None], keys[None], values[None], attn_mask=causal_lower_right(n, context),
        scale=scale,
    )  # fmt: skip
    return out[0, ..., :dv]


def compact_batch(
    metadata: AttentionMetadata, skip: list[int]
) -> tuple[torch.Tensor, AttentionMetadata]:
    """The step's sequences other than `skip` as a batch of their own: their token rows in the
    step (int64, on the metadata's device) and metadata counting only them."""
    device = metadata.seq_lens.device
    starts = list(accumulate(metadata.query_lens_cpu, initial=0))
    skipped = set(skip)
    keep = [i for i in range(metadata.num_seqs) if i not in skipped]
    rows = [t for i in keep for t in range(starts[i], starts[i + 1])]
    query_lens = [metadata.query_lens_cpu[i] for i in keep]
    seq_lens = [metadata.seq_lens_cpu[i] for i in keep]
    index = torch.tensor(keep, dtype=torch.int64, device=device)
    row_index = torch.tensor(rows, dtype=torch.int64, device=device)
    cum = list(accumulate(query_lens, initial=0))
    part = AttentionMetadata(
        query_start_loc=torch.tensor(cum, dtype=torch.int32, device=device),
        seq_lens=metadata.seq_lens[index],
        block_tables=metadata.block_tables[index],
        slot_mapping=metadata.slot_mapping[row_index],
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return row_index, part
