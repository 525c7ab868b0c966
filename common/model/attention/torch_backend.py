"""Reference attention on plain torch ops: correct on CPU and GPU, not fast.

Decode-only batches gather every sequence's blocks into one padded tensor; batches with
prefill tokens loop over sequences with an explicit causal mask offset by the cached context.
An FP8 cache (contract in `base`) is dequantized to fp32 after the gather and attended in fp32.
MLA runs the absorbed form in fp32 for decode: a query row is [q_nope W_UK | q_pe] against
cached [latent | k_pe] rows, the values are the latents. Prefill runs each sequence in the form
`mla_prefill` picks (`mla_prefill.decompressed_sequences`): absorbed as decode does, or
decompressed (`mla_prefill.decompressed_sequence`, in q's dtype), the CPU reference of the
triton backend's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.model.attention.base import (
    AttentionMetadata,
    DecodeOrPrefillBackend,
    LatentProjection,
)
from common.model.attention.mla_prefill import (
    context_rows,
    decompressed_sequence,
    decompressed_sequences,
)
from common.model.quantization.fp8_ops import FP8, quantize


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter new k/v rows into the paged cache. Slots must be valid (padding rows use the
    pool's padding slot), which keeps this free of host syncs and safe to capture. An FP8 cache
    gets `fp8_ops.quantize` of the rows; other caches a cast, the scales ignored."""
    write_rows(k, k_cache, slots, k_scale)
    write_rows(v, v_cache, slots, v_scale)


def write_latent(
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    kv_scale: float = 1.0,
) -> None:
    """MLA: rows `[latent | k_pe]` ([T, kv_lora_rank], [T, rope]) into the one-plane cache, as
    `write_kv` writes K."""
    write_rows(torch.cat((latent, k_pe), dim=-1).unsqueeze(1), cache, slots, kv_scale)


def write_rows(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, scale: float) -> None:
    flat = cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])
    if cache.dtype == FP8:
        if not scale > 0:
            raise ValueError(f"FP8 KV scales must be positive, got {scale}")
        # index_copy_ has no fp8 kernel on CPU; the bytes are the same through uint8. The
        # scale is a device tensor because CUDA divides by a host scalar as a multiply by
        # its reciprocal, which is not always the correctly rounded quotient.
        divisor = torch.full((), scale, dtype=torch.float32, device=rows.device)
        values = quantize(rows, divisor).view(torch.uint8)
        flat.view(torch.uint8).index_copy_(0, slots, values)
    else:
        flat.index_copy_(0, slots, rows.to(cache.dtype))


def dequantize(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache rows as attention reads them: FP8 as `rows.float() * scale`, others unchanged."""
    return rows.float() * scale if rows.dtype == FP8 else rows


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached rows of one sequence: [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    rows = cache[block_table[:num_blocks].long()]
    return rows.reshape(-1, *cache.shape[2:])[:length]


class TorchAttentionBackend(DecodeOrPrefillBackend):
    name = "torch"

    write_kv = staticmethod(write_kv)
    write_latent = staticmethod(write_latent)

    def decode(
        self, q, k_cache, v_cache, metadata: AttentionMetadata, scale: float,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ):  # fmt: skip
        num_seqs = metadata.num_seqs
        block_size = k_cache.shape[1]
        max_blocks = (metadata.max_seq_len + block_size - 1) // block_size
        tables = metadata.block_tables[:num_seqs, :max_blocks].long()
        # [B, max_blocks*block_size, kv_heads, d]
        keys = dequantize(k_cache[tables].flatten(1, 2), k_scale)
        values = dequantize(v_cache[tables].flatten(1, 2), v_scale)
        positions = torch.arange(keys.shape[1], device=q.device)
        valid = positions[None, :] < metadata.seq_lens[:num_seqs, None]
        out = F.scaled_dot_product_attention(
            q[:num_seqs].unsqueeze(2).to(keys.dtype),  # [B, heads, 1, d]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=valid[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        result = torch.zeros_like(q)
        result[:num_seqs] = out.squeeze(2).to(q.dtype)
        return result

    def prefill(
        self, q, k_cache, v_cache, metadata: AttentionMetadata, scale: float,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ):  # fmt: skip
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, ctx_len) in enumerate(
            zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)
        ):
            table = metadata.block_tables[i]
            keys = dequantize(gather_context(k_cache, table, ctx_len), k_scale).transpose(0, 1)
            values = dequantize(gather_context(v_cache, table, ctx_len), v_scale).transpose(0, 1)
            query = q[start : start + q_len].transpose(0, 1)
            # Query j sits at absolute position ctx_len - q_len + j and sees keys up to it.
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
            k_pos = torch.arange(ctx_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(
                query.to(keys.dtype), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )
            out[start : start + q_len] = o.transpose(0, 1).to(q.dtype)
            start += q_len
        if start < q.shape[0]:
            out[start:] = 0
        return out

    def latent_decode(
        self, q_abs, q_pe, cache, metadata: AttentionMetadata, scale: float,
        kv_scale: float = 1.0,
    ):  # fmt: skip
        num_seqs = metadata.num_seqs
        block_size = cache.shape[1]
        max_blocks = (metadata.max_seq_len + block_size - 1) // block_size
        tables = metadata.block_tables[:num_seqs, :max_blocks].long()
        rows = dequantize(cache[tables].flatten(1, 3), kv_scale).float()  # [B, S, latent+rope]
        query = torch.cat((q_abs[:num_seqs], q_pe[:num_seqs]), dim=-1).float()
        scores = torch.einsum("bhd,bsd->bhs", query, rows) * scale
        positions = torch.arange(rows.shape[1], device=q_abs.device)
        valid = positions[None, :] < metadata.seq_lens[:num_seqs, None]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        latent = rows[..., : q_abs.shape[-1]]
        out = torch.zeros_like(q_abs)
        out[:num_seqs] = torch.einsum("bhs,bsl->bhl", scores.softmax(-1), latent).to(q_abs.dtype)
        return out

    def latent_prefill(
        self, q_nope, q_pe, proj: LatentProjection, cache, metadata: AttentionMetadata,
        scale: float, kv_scale: float = 1.0,
    ):  # fmt: skip
        decompressed = set(decompressed_sequences(self.mla_prefill, metadata, q_nope.shape[1]))
        out = q_nope.new_zeros(*q_nope.shape[:2], proj.w_uv.shape[1])
        start = 0
        for i, (q_len, ctx_len) in enumerate(
            zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)
        ):
            part = slice(start, start + q_len)
            rows = context_rows(cache, metadata.block_tables[i], ctx_len, kv_scale)
            if i in decompressed:
                out[part] = decompressed_sequence(q_nope[part], q_pe[part], proj, rows, scale)
            else:
                out[part] = absorbed_sequence(q_nope[part], q_pe[part], proj, rows, scale)
            start += q_len
        return out


def absorbed_sequence(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    proj: LatentProjection,
    rows: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`mla_prefill.decompressed_sequence`'s contract in absorbed form, attended in fp32."""
    q_abs = proj.absorb(q_nope)
    rows = rows.float()
    query = torch.cat((q_abs, q_pe), dim=-1).float()
    scores = torch.einsum("qhd,sd->hqs", query, rows) * scale
    # Query j sits at absolute position ctx_len - q_len + j and sees keys up to it.
    q_len, ctx_len = q_nope.shape[0], rows.shape[0]
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=rows.device)
    k_pos = torch.arange(ctx_len, device=rows.device)
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    latent = rows[:, : q_abs.shape[-1]]
    out = torch.einsum("hqs,sl->qhl", scores.softmax(-1), latent).to(q_abs.dtype)
    return proj.expand(out)
