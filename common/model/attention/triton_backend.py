"""Attention on our Triton kernels (`common.model.kernels`): fused KV write, then paged prefill or
split-K decode; a step of long fresh prompts on CUDA attends through PyTorch's fused SDPA
kernel instead (`fresh_prefill`). Runs compiled on CUDA and, under `TRITON_INTERPRET=1`, on CPU
(tests).

CUDA-graph contract of the decode path: on the host it uses only tensor shapes and
`metadata.max_seq_len` (an upper bound that picks the split count); per-sequence lengths are
read on the device. Its split scratch buffers are allocated on the first call with a given
shape (the warm-up before capture) and reused by every later call and replay, so a replay
allocates nothing. Calls run in stream order, so one buffer serves every layer. FP8 caches
(contract in `base`) are written and read by the same kernels with the layer's scales.
`metadata.decode_groups` makes a verify step's rows of one sequence read its KV once.
MLA runs `common.model.kernels.mla_decode` (absorbed decode) and `mla_attention` (absorbed
prefill, latent write), imported on first use; its decode keeps split scratch buffers under the
same contract. A prefill step's sequences that `mla_prefill` decompresses run
`mla_prefill.decompressed_sequence` (torch ops: gather, the kv_b_proj GEMMs, SDPA); the others
run the absorbed kernel, as a compact batch of their own when the step has both kinds
(`mla_prefill.compact_batch`, built once per step).
"""

from __future__ import annotations

from itertools import accumulate

import torch

from common.model.attention.base import (
    AttentionMetadata,
    DecodeOrPrefillBackend,
    LatentProjection,
)
from common.model.attention.fresh_prefill import fresh_prefill, takes_fresh_path
from common.model.attention.mla_prefill import (
    compact_batch,
    context_rows,
    decompressed_sequence,
    decompressed_sequences,
)
from common.model.kernels.fused_ops import write_kv
from common.model.kernels.paged_attention import (
    DecodeScratch,
    decode_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
)


class TritonAttentionBackend(DecodeOrPrefillBackend):
    name = "triton"

    def __init__(self, mla_prefill: str = "auto") -> None:
        super().__init__(mla_prefill)
        # (num_seqs, num_heads, num_splits, head_dim, device) -> scratch; owned for the
        # backend's lifetime because captured graphs keep pointers into it.
        self._scratch: dict[tuple[int, int, int, int, torch.device], DecodeScratch] = {}
        # The last prefill step's split into forms: (its metadata, decompressed sequences,
        # the absorbed ones' rows and compact metadata, or None). A step's layers share one
        # metadata object, built per step and never modified (`ModelRunner.metadata`).
        self._split: tuple[AttentionMetadata, list[int], tuple | None] | None = None

    write_kv = staticmethod(write_kv)

    def forward(
        self, q, k, v, k_cache, v_cache, metadata: AttentionMetadata, scale: float,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ):  # fmt: skip
        """As `DecodeOrPrefillBackend.forward`, but a step of fresh prompts attends over its
        new k and v through SDPA (`fresh_prefill`); the cache is written first all
        the same."""
        if metadata.is_decode_only or not takes_fresh_path(q, k_cache, metadata):
            return super().forward(q, k, v, k_cache, v_cache, metadata, scale, k_scale, v_scale)
        self.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
        return fresh_prefill(q, k, v, metadata, scale)

    def decode(
        self, q, k_cache, v_cache, metadata: AttentionMetadata, scale: float,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ):  # fmt: skip
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_seqs = min(q.shape[0], metadata.seq_lens.shape[0])
        if num_seqs < q.shape[0]:  # query rows without a sequence
            out[num_seqs:].zero_()
        groups, rows_max = metadata.decode_groups, metadata.decode_rows_max
        if groups is None:
            rows_max = 1
        # Grouped, only the runs' leaders work: size the splits for a batch of runs.
        leaders = -(-num_seqs // rows_max)
        splits = decode_num_splits(leaders, k_cache.shape[2], metadata.max_seq_len, q.device)
        scratch = None
        if splits > 1:
            key = (num_seqs, q.shape[1], splits, q.shape[2], q.device)
            scratch = self._scratch.get(key)
            if scratch is None:
                scratch = self._scratch[key] = DecodeScratch.allocate(*key)
        paged_decode_attention(
            q[:num_seqs],
            k_cache,
            v_cache,
            out[:num_seqs],
            metadata.seq_lens,
            metadata.block_tables,
            scale,
            scratch,
            k_scale=k_scale,
            v_scale=v_scale,
            groups=groups,
            rows_max=rows_max,
        )
        return out

    def prefill(
        self, q, k_cache, v_cache, metadata: AttentionMetadata, scale: float,
        k_scale: float = 1.0, v_scale: float = 1.0,
    ):  # fmt: skip
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_tokens = sum(metadata.query_lens_cpu)
        if num_tokens < q.shape[0]:  # padding tokens after the last sequence
            out[num_tokens:].zero_()
        paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            out,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            metadata.max_query_len,
            scale,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        return out

    @staticmethod
    def write_latent(latent, k_pe, cache, slots: torch.Tensor, kv_scale: float = 1.0) -> None:
        from common.model.kernels import mla_attention

        mla_attention.write_latent(latent, k_pe, cache, slots, kv_scale)

    def latent_decode(
        self, q_abs, q_pe, cache, metadata: AttentionMetadata, scale: float,
        kv_scale: float = 1.0,
    ):  # fmt: skip
        from common.model.kernels import mla_decode

        out = torch.empty(q_abs.shape, dtype=q_abs.dtype, device=q_abs.device)
        num_seqs = min(q_abs.shape[0], metadata.seq_lens.shape[0])
        if num_seqs < q_abs.shape[0]:  # query rows without a sequence
            out[num_seqs:].zero_()
        heads, rank, device = q_abs.shape[1], q_abs.shape[2], q_abs.device
        splits = mla_decode.mla_decode_splits(num_seqs, heads, device, metadata.max_seq_len)
        key = (num_seqs, heads, splits, rank, device)
        scratch = self._scratch.get(key)
        if scratch is None:
            scratch = self._scratch[key] = mla_decode.mla_decode_scratch(
                num_seqs, heads, rank, device, metadata.max_seq_len
            )
        mla_decode.paged_mla_decode(
            q_abs[:num_seqs], q_pe[:num_seqs], cache, metadata.block_tables, metadata.seq_lens,
            scale, kv_scale, out[:num_seqs], scratch=scratch,
        )  # fmt: skip
        return out

    def latent_prefill(
        self, q_nope, q_pe, proj: LatentProjection, cache, metadata: AttentionMetadata,
        scale: float, kv_scale: float = 1.0,
    ):  # fmt: skip
        decompressed, absorbed = self._split_forms(metadata, q_nope.shape[1])
        if not decompressed:
            return self._absorbed(q_nope, q_pe, proj, cache, metadata, scale, kv_scale)
        out = torch.empty(*q_nope.shape[:2], proj.w_uv.shape[1], dtype=q_nope.dtype,
                          device=q_nope.device)  # fmt: skip
        starts = list(accumulate(metadata.query_lens_cpu, initial=0))
        if starts[-1] < out.shape[0]:  # padding tokens after the last sequence
            out[starts[-1] :].zero_()
        if absorbed is not None:
            rows, part = absorbed
            got = self._absorbed(q_nope[rows], q_pe[rows], proj, cache, part, scale, kv_scale)
            out.index_copy_(0, rows, got)
        for i in decompressed:
            seq = slice(starts[i], starts[i + 1])
            context = context_rows(cache, metadata.block_tables[i], metadata.seq_lens_cpu[i],
                                   kv_scale)  # fmt: skip
            out[seq] = decompressed_sequence(q_nope[seq], q_pe[seq], proj, context, scale)
        return out

    def _split_forms(
        self, metadata: AttentionMetadata, heads: int
    ) -> tuple[list[int], tuple[torch.Tensor, AttentionMetadata] | None]:
        """(decompressed sequences, the absorbed ones' (rows, metadata) when some of each)."""
        if self._split is None or self._split[0] is not metadata:
            decompressed = decompressed_sequences(self.mla_prefill, metadata, heads)
            mixed = 0 < len(decompressed) < metadata.num_seqs
            absorbed = compact_batch(metadata, decompressed) if mixed else None
            self._split = (metadata, decompressed, absorbed)
        return self._split[1], self._split[2]

    @staticmethod
    def _absorbed(q_nope, q_pe, proj: LatentProjection, cache, metadata: AttentionMetadata,
                  scale: float, kv_scale: float) -> torch.Tensor:  # fmt: skip
        from common.model.kernels import mla_attention

        out = mla_attention.paged_mla_prefill(
            proj.absorb(q_nope), q_pe, cache, metadata.query_start_loc, metadata.seq_lens,
            metadata.block_tables, metadata.max_query_len, scale, kv_scale,
        )  # fmt: skip
        num_tokens = sum(metadata.query_lens_cpu)
        if num_tokens < out.shape[0]:  # padding tokens after the last sequence: not written
            out[num_tokens:].zero_()
        return proj.expand(out)
