"""flash-attn backend: FlashAttention-2's paged API, or FlashAttention-4's `flash_attn.cute`.

FA2: prefill through `flash_attn_varlen_func` with `block_table` (KV read from the paged cache,
causal aligned to the end of each sequence, so cached prefixes and earlier chunks work) and
decode through `flash_attn_with_kvcache` with `block_table` and `cache_seqlens` (device tensors
only: CUDA-graph safe). FA2's paged kernels need a page size that is a multiple of
`REQUIRED_BLOCK_SIZE_MULTIPLE`; `check_block_size` rejects others so the worker can pick a
larger page. FA4 (`flash_attn.cute`): one varlen call with `page_table` and `seqused_k` for both.
Neither paged API reads our FP8 cache layout with per-layer scales: FP8 KV is refused
(`check_kv_dtype`), and `auto` picks triton for it. Neither has DeepSeek's latent attention
(`check_latent`): MLA models run on triton.
"""

from __future__ import annotations

import torch

from common.model.attention.base import AttentionMetadata
from common.model.attention.torch_backend import write_kv

REQUIRED_BLOCK_SIZE_MULTIPLE = 256


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def check_block_size(block_size: int) -> None:
    if block_size % REQUIRED_BLOCK_SIZE_MULTIPLE:
        raise ValueError(
            f"the flash_attn backend needs --block-size a multiple of {REQUIRED_BLOCK_SIZE_MULTIPLE}, got {block_size}"
        )


def check_kv_dtype(kv_dtype: torch.dtype | None) -> None:
    if kv_dtype == torch.float8_e4m3fn:
        raise ValueError(
            f"the flash_attn attention backend cannot read a {kv_dtype} (FP8) KV cache; "
            "use --attention-backend triton or torch, or --kv-cache-dtype auto"
        )


NO_LATENT = (
    "the flash_attn attention backend has no multi-head latent attention (DeepSeek MLA) path; "
    "use --attention-backend triton or torch"
)


def check_latent(latent: bool) -> None:
    if latent:
        raise ValueError(NO_LATENT)


class FlashAttnBackend:
    name = "flash_attn"

    def __init__(self) -> None:
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

            self._varlen, self._with_kvcache, self._cute = (
                flash_attn_varlen_func,
                flash_attn_with_kvcache,
                None,
            )
        except ImportError:
            from flash_attn.cute import flash_attn_varlen_func as cute_varlen

            self._varlen = self._with_kvcache = None
            self._cute = cute_varlen

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        check_kv_dtype(k_cache.dtype)
        write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        if self._cute is not None:
            out = self._cute(
                q,
                k_cache,
                v_cache,
                cu_seqlens_q=metadata.query_start_loc,
                seqused_k=metadata.seq_lens,
                page_table=metadata.block_tables,
                softmax_scale=scale,
                causal=True,
            )
            return out[0] if isinstance(out, tuple) else out
        if metadata.is_decode_only:
            out = self._with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=metadata.seq_lens,
                block_table=metadata.block_tables,
                softmax_scale=scale,
                causal=True,
            )
            return out.squeeze(1)
        cu_k = torch.zeros(metadata.num_seqs + 1, dtype=torch.int32, device=q.device)
        torch.cumsum(metadata.seq_lens, 0, out=cu_k[1:])
        return self._varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=metadata.query_start_loc,
            cu_seqlens_k=cu_k,
            max_seqlen_q=metadata.max_query_len,
            max_seqlen_k=metadata.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=metadata.block_tables,
        )

    def latent_forward(self, *args, **kwargs) -> torch.Tensor:
        raise ValueError(NO_LATENT)
