"""The attention-backend interface the model code is written against.

Contract: the model calls `ForwardContext.attention(layer, q, k, v)` once per layer with the
step's new tokens flattened (`[num_tokens, heads, head_dim]`). The backend writes k and v into
the paged cache at `slot_mapping` and returns attention over each sequence's whole context
(cached prefix + earlier chunks + these tokens), causal within the new tokens.

Multi-head latent attention (DeepSeek's MLA) goes through `ForwardContext.latent_attention`
instead: the layer's cache holds one row per token, `[latent | k_pe]` (kv_lora_rank +
qk_rope_head_dim values, one "head" every query head reads). The backend writes the new rows
at `slot_mapping` and returns each query head's attention output in value space. Decode runs
the absorbed form: the key projection is folded into the query (`LatentProjection.absorb`),
attention runs over the latent rows themselves, the value projection is applied after
(`LatentProjection.expand`). Prefill gets the unabsorbed query and the projection, so a
backend may run it absorbed or rebuild each head's K and V (`LatentProjection.decompress`):
the torch and triton backends choose per sequence as their `mla_prefill` mode says
(`MLA_PREFILL_MODES`; the rule and the decompressed form in `mla_prefill`).

FP8 KV: a `torch.float8_e4m3fn` cache stores `clamp(x / scale, -448, 448)` rounded to nearest
even (`common.model.quantization.fp8_ops.quantize`) and reads as `stored.float() * scale`, with
one K and one V scale per layer (MLA: one latent scale), plain floats fixed for the process, so
CUDA graphs bake them. Caches of any other dtype ignore the scales.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

# How a prefill (or mixed) step runs MLA: "absorbed" (every sequence over the latent rows),
# "decompressed" (every sequence over rebuilt per-head K and V) or "auto" (per sequence, by
# `mla_prefill.AUTO_DECOMPRESS`). Decode-only steps always run absorbed. `EngineConfig` lists
# the same names (torch-free, it cannot import this module).
MLA_PREFILL_MODES = ("auto", "absorbed", "decompressed")
# A layer's output projection: (attended, out or None) -> the projection, written into `out`
# when one is given (`ForwardContext.attention_projected`).
Projector = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def check_mla_prefill(mode: str) -> str:
    if mode not in MLA_PREFILL_MODES:
        raise ValueError(f"mla_prefill must be one of {MLA_PREFILL_MODES}, got {mode!r}")
    return mode


@dataclass
class AttentionMetadata:
    """Where a flattened batch's tokens sit in the paged KV cache.

    Sequence i owns new tokens `query_start_loc[i]:query_start_loc[i+1]`, which are the last
    `query_lens[i]` of its `seq_lens[i]` context tokens. `slot_mapping[t] = block * block_size
    + offset` for every new token; padding tokens point at the pool's padding slot.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64, always a valid slot
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # Decode only, optional: runs of rows that share a block table (a verify step's rows of
    # one sequence), read once by the triton backend (`paged_decode_attention`'s `groups`):
    # [B] int32, n on a run's first row, 0 on its others, 1 on a plain row; runs have at most
    # `decode_rows_max` rows (a host value fixed per engine, so graphs keep one launch). Other
    # backends ignore them: the rows are independent, the results the same.
    decode_groups: torch.Tensor | None = None
    decode_rows_max: int = 1

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True)
class LatentProjection:
    """One MLA layer's `kv_b_proj`, per query head: `w_uk` [heads, qk_nope_head_dim,
    kv_lora_rank] rebuilds the non-rotary key from the latent, `w_uv` [heads, v_head_dim,
    kv_lora_rank] the value."""

    w_uk: torch.Tensor
    w_uv: torch.Tensor

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, heads, qk_nope] -> [T, heads, kv_lora_rank]: its dot with a latent row
        is its dot with that row's key."""
        return torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)

    def expand(self, out: torch.Tensor) -> torch.Tensor:
        """Attention over latent rows [T, heads, kv_lora_rank] -> over values [T, heads, v]."""
        return torch.bmm(out.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)

    def decompress(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [S, kv_lora_rank] -> every head's non-rotary keys [heads, S, qk_nope]
        and values [heads, S, v] (the unabsorbed form), heads first as attention reads them."""
        rows = latent.expand(self.w_uk.shape[0], *latent.shape)  # one latent, every head
        keys = torch.bmm(rows, self.w_uk.transpose(1, 2))
        return keys, torch.bmm(rows, self.w_uv.transpose(1, 2))


class AttentionBackend(Protocol):
    """One implementation per kernel family (torch reference, triton, flash_attn)."""

    name: str

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
    ) -> torch.Tensor: ...

    def latent_forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        proj: LatentProjection,
        cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        kv_scale: float = 1.0,
    ) -> torch.Tensor: ...


class DecodeOrPrefillBackend:
    """A backend with one kernel path per batch kind: it writes the new k/v into the cache,
    then runs `decode` on a decode-only batch (one query row per sequence; rows past the
    batch's sequences are padding) and `prefill` on any other. Both return [T, heads, d]
    with padding rows zeroed. `mla_prefill` (`MLA_PREFILL_MODES`) is the form its
    `latent_prefill` runs."""

    name: str

    def __init__(self, mla_prefill: str = "auto") -> None:
        self.mla_prefill = check_mla_prefill(mla_prefill)

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
        self.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
        if metadata.is_decode_only:
            return self.decode(q, k_cache, v_cache, metadata, scale, k_scale, v_scale)
        return self.prefill(q, k_cache, v_cache, metadata, scale, k_scale, v_scale)

    def latent_forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        proj: LatentProjection,
        cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        kv_scale: float = 1.0,
    ) -> torch.Tensor:
        """MLA (contract in the module docstring): q_nope [T, heads, qk_nope], q_pe [T, heads,
        rope], latent [T, kv_lora_rank], k_pe [T, rope], cache [blocks + 1, block_size, 1,
        kv_lora_rank + rope] -> [T, heads, v_head_dim], padding rows zeroed."""
        self.write_latent(latent, k_pe, cache, metadata.slot_mapping, kv_scale)
        if metadata.is_decode_only:
            out = self.latent_decode(proj.absorb(q_nope), q_pe, cache, metadata, scale, kv_scale)
            return proj.expand(out)
        return self.latent_prefill(q_nope, q_pe, proj, cache, metadata, scale, kv_scale)

    def write_latent(
        self, latent, k_pe, cache, slots: torch.Tensor, kv_scale: float = 1.0
    ) -> None:  # fmt: skip
        raise NotImplementedError

    def latent_decode(
        self, q_abs, q_pe, cache, metadata: AttentionMetadata, scale: float,
        kv_scale: float = 1.0,
    ):  # fmt: skip
        """Absorbed queries [T, heads, kv_lora_rank] -> [T, heads, kv_lora_rank]."""
        raise NotImplementedError

    def latent_prefill(
        self, q_nope, q_pe, proj: LatentProjection, cache, metadata: AttentionMetadata,
        scale: float, kv_scale: float = 1.0,
    ):  # fmt: skip
        """Unabsorbed queries -> [T, heads, v_head_dim] (the seam of a decompressing prefill)."""
        raise NotImplementedError

    def write_kv(
        self, k, v, k_cache, v_cache, slots: torch.Tensor, k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:  # fmt: skip
        raise NotImplementedError

    def decode(
        self, q, k_cache, v_cache, metadata: AttentionMetadata, scale: float,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ):  # fmt: skip
        raise NotImplementedError

    def prefill(
        self, q, k_cache, v_cache, metadata: AttentionMetadata, scale: float,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ):  # fmt: skip
        raise NotImplementedError


class ForwardContext:
    """Binds one step's metadata and the KV cache to a backend for the model's layers.

    `on_layer_done(layer)` (optional) runs after a layer's KV is in the cache; the prefill
    node uses it to ship that layer while the next ones compute. `k_scales`/`v_scales` hold
    one FP8 scale per layer; None means 1.0 for every layer. An MLA pool passes its per-layer
    `latent_caches` (and `latent_scales`) instead of K/V caches (empty lists).
    """

    def __init__(
        self,
        backend: AttentionBackend,
        metadata: AttentionMetadata,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        scale: float,
        on_layer_done: Callable[[int], None] | None = None,
        k_scales: Sequence[float] | None = None,
        v_scales: Sequence[float] | None = None,
        latent_caches: list[torch.Tensor] | None = None,
        latent_scales: Sequence[float] | None = None,
    ) -> None:
        num_layers = len(k_caches) if latent_caches is None else len(latent_caches)
        for name, scales in (
            ("k_scales", k_scales), ("v_scales", v_scales), ("latent_scales", latent_scales)
        ):  # fmt: skip
            if scales is not None and len(scales) != num_layers:
                raise ValueError(f"{name} has {len(scales)} entries for {num_layers} layers")
        self.backend = backend
        self.metadata = metadata
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.scale = scale
        self.on_layer_done = on_layer_done
        self.k_scales = k_scales
        self.v_scales = v_scales
        self.latent_caches = latent_caches
        self.latent_scales = latent_scales

    def projection_buffer(self, rows: int, width: int) -> torch.Tensor | None:
        """Where a layer's qkv projection may write its [rows, width] output, or None for a
        tensor of its own. A prefill graph's pieces (`prefill_graphs._Boundary`) offer their
        static buffer, so the projection lands where the eager attention reads it."""
        return None

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_scale = 1.0 if self.k_scales is None else self.k_scales[layer]
        v_scale = 1.0 if self.v_scales is None else self.v_scales[layer]
        out = self.backend.forward(
            q, k, v, self.k_caches[layer], self.v_caches[layer], self.metadata, self.scale,
            k_scale, v_scale,
        )  # fmt: skip
        if self.on_layer_done is not None:
            self.on_layer_done(layer)
        return out

    def attention_projected(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        project: Projector,
    ) -> torch.Tensor:
        """`attention`, then the layer's output projection `project(attended, out)`. The
        prefill graphs (`prefill_graphs._Boundary`) run the projection eagerly with the
        attention, into a static buffer the next piece reads: the attention's own output
        tensor needs no copy into a buffer then."""
        return project(self.attention(layer, q, k, v), None)

    def latent_attention(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        proj: LatentProjection,
    ) -> torch.Tensor:
        """MLA's counterpart of `attention` (module docstring): [T, heads, v_head_dim]."""
        if self.latent_caches is None:
            raise ValueError("latent attention needs an MLA KV pool; this one holds K and V")
        kv_scale = 1.0 if self.latent_scales is None else self.latent_scales[layer]
        out = self.backend.latent_forward(
            q_nope, q_pe, latent, k_pe, proj, self.latent_caches[layer], self.metadata,
            self.scale, kv_scale,
        )  # fmt: skip
        if self.on_layer_done is not None:
            self.on_layer_done(layer)
        return out
