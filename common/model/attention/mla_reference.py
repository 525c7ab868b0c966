"""MLA attention (absorbed form) on plain torch ops: the oracle of
`common.model.kernels.mla_attention` and `mla_decode` and the CPU model path. Correct, not fast.

Same cache and math as the kernels (`mla_attention`'s module docstring): one `[num_blocks + 1,
page_size, 1, Dc + Dr]` pool per layer, the last block the padding block; key n of a sequence
scores `scale * (q_nope . c_n + q_pe . kpe_n)`, the output is `sum_n p_n c_n`. Pages are
gathered per sequence and attended in float32 (an FP8 cache as `stored * kv_scale`). The lengths
are read on the host (`tolist`), so `mla_reference` is not CUDA-graph capturable;
`write_latent_reference` is (no host reads).
"""

from __future__ import annotations

import torch

from common.model.quantization.fp8_ops import FP8, quantize


def mla_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    kv_scale: float = 1.0,
    query_start_loc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q_nope [T, H, Dc] / q_pe [T, H, Dr] over the paged cache -> [T, H, Dc] in
    q's dtype.

    Decode (`query_start_loc` None): row i is sequence i's last token and sees its first
    `seq_lens[i]` keys; a row of length 0 gets zeros. Prefill: sequence i's tokens
    `query_start_loc[i]:query_start_loc[i + 1]` are the last of its `seq_lens[i]` keys and
    see the cached prefix and, causally, each other; rows outside every sequence get zeros.
    """
    num_seqs = q_nope.shape[0] if query_start_loc is None else query_start_loc.shape[0] - 1
    starts = list(range(num_seqs + 1)) if query_start_loc is None else query_start_loc.tolist()
    dc, page = q_nope.shape[2], cache.shape[1]
    flat = cache.flatten(0, 1)[:, 0]  # [slots, Dc + Dr]
    dequant = kv_scale if cache.dtype == FP8 else 1.0
    out = torch.zeros(q_nope.shape, dtype=torch.float32, device=q_nope.device)
    for i, seq_len in enumerate(seq_lens[:num_seqs].tolist()):
        start, end = starts[i], starts[i + 1]
        if seq_len == 0 or start == end:
            continue
        pos = torch.arange(seq_len, device=cache.device)
        rows = flat[block_tables[i].long()[pos // page] * page + pos % page].float() * dequant
        latent, rope = rows[:, :dc], rows[:, dc:]
        scores = torch.einsum("thc,nc->thn", q_nope[start:end].float(), latent)
        scores = (scores + torch.einsum("thr,nr->thn", q_pe[start:end].float(), rope)) * scale
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=cache.device)
        visible = pos[None, None, :] <= q_pos[:, None, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("thn,nc->thc", probs, latent)
    return out.to(q_nope.dtype)


def write_latent_reference(
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float = 1.0,
) -> None:
    """Store latent [T, Dc] and k_pe [T, Dr] rows at `slot_mapping` as the kernel's
    `write_latent` does (FP8: `fp8_ops.quantize`). A slot < 0 writes into the padding block
    (the last one, never read as context) instead of being skipped: no host sync."""
    flat = cache.view(cache.shape[0] * cache.shape[1], cache.shape[3])
    padding_slot = (cache.shape[0] - 1) * cache.shape[1]
    slots = torch.where(slot_mapping < 0, padding_slot, slot_mapping).long()
    rows = torch.cat([latent, k_pe], dim=1)
    if cache.dtype != FP8:
        flat.index_copy_(0, slots, rows.to(cache.dtype))
        return
    if not kv_scale > 0:
        raise ValueError(f"FP8 MLA cache needs a positive kv_scale, got {kv_scale}")
    # A device divisor: CUDA divides by a host scalar as a multiply by its reciprocal, not
    # always the correctly rounded quotient. index_copy_ has no fp8 kernel on CPU: go by bytes.
    divisor = torch.full((), kv_scale, dtype=torch.float32, device=rows.device)
    flat.view(torch.uint8).index_copy_(0, slots, quantize(rows, divisor).view(torch.uint8))
