"""Turns a ScheduledBatch into tensors, runs the model, samples one token per finishing row.

Decode-only batches replay a captured CUDA graph when one is available (`common.cuda_graphs`);
everything else (prefill, chunks, mixed batches, CPU) runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.attention import AttentionBackend, AttentionMetadata, ForwardContext
from common.cuda_graphs import DecodeGraphs
from common.kv_cache import KVCache
from common.models.llama import LlamaForCausalLM
from common.sampler import Sampler, SamplingInputs, to_host
from common.scheduler import SampledToken, ScheduledBatch
from common.sequence import Sequence


@dataclass
class HostInputs:
    """One step's inputs as plain lists, before they become tensors or graph buffers."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    row_keys: list[tuple[str, int, int]]  # identifies each row's block list (see DecodeGraphs.run)
    logits_indices: list[int]  # token index of each sampling row
    sample_rows: list[int]  # batch item index of each sampling row

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens) and len(self.sample_rows) == len(
            self.query_lens
        )


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        backend: AttentionBackend,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.block_size = kv_cache.block_size
        self.scale = model.spec.head_dim**-0.5
        self.sampler = Sampler(model.spec.vocab_size, device)
        self.eos_token_ids = list(model.spec.eos_token_ids)
        self.graphs: DecodeGraphs | None = None
        self._k_caches = kv_cache.k_caches
        self._v_caches = kv_cache.v_caches

    def capture_graphs(self, max_num_seqs: int, max_model_len: int) -> int:
        """Capture decode graphs (CUDA only); returns the bytes they hold."""
        self.graphs = DecodeGraphs(
            self.model, self.backend, self.kv_cache, max_num_seqs, max_model_len, self.scale
        )
        return self.graphs.capture()

    def release(self, request_id: str) -> None:
        """Forget per-request sampler state (noise key, token counts) once it has ended."""
        self.sampler.release(request_id)

    def host_inputs(self, batch: ScheduledBatch) -> HostInputs:
        bs = self.block_size
        h = HostInputs([], [], [], [], [], [], [], [], [])
        for row, item in enumerate(batch.items):
            seq, start, n = item.seq, item.start, item.num_new_tokens
            h.input_ids.extend(
                seq.all_token_ids[start : start + n] if n > 1 else [seq.token_at(start)]
            )
            h.positions.extend(range(start, start + n))
            blocks = seq.block_ids
            h.slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            h.query_lens.append(n)
            h.seq_lens.append(start + n)
            h.block_tables.append(blocks)
            h.row_keys.append((seq.request_id, seq.num_preemptions, len(blocks)))
            if item.samples:
                h.logits_indices.append(len(h.input_ids) - 1)
                h.sample_rows.append(row)
        return h

    def _tensor(self, values, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def metadata(self, h: HostInputs) -> AttentionMetadata:
        width = max(len(t) for t in h.block_tables)
        cum = [0]
        for n in h.query_lens:
            cum.append(cum[-1] + n)
        return AttentionMetadata(
            query_start_loc=self._tensor(cum, torch.int32),
            seq_lens=self._tensor(h.seq_lens, torch.int32),
            block_tables=self._tensor(
                [t + [0] * (width - len(t)) for t in h.block_tables], torch.int32
            ),
            slot_mapping=self._tensor(h.slots, torch.int64),
            query_lens_cpu=h.query_lens,
            seq_lens_cpu=h.seq_lens,
            max_query_len=max(h.query_lens),
            max_seq_len=max(h.seq_lens),
        )

    @torch.inference_mode()
    def execute(
        self, batch: ScheduledBatch, on_layer_done: Callable[[int], None] | None = None
    ) -> list[SampledToken | None]:
        """Run one step; returns one entry per batch item (None where no token is sampled)."""
        h = self.host_inputs(batch)
        if (
            self.graphs is not None
            and on_layer_done is None
            and h.is_decode_only
            and self.graphs.fits(len(h.input_ids))
        ):
            logits = self.graphs.run(
                h.input_ids, h.positions, h.slots, h.seq_lens, h.block_tables, h.row_keys
            )
        else:
            ctx = ForwardContext(
                self.backend,
                self.metadata(h),
                self._k_caches,
                self._v_caches,
                self.scale,
                on_layer_done,
            )
            hidden = self.model(
                self._tensor(h.input_ids, torch.int64), self._tensor(h.positions, torch.int64), ctx
            )
            if not h.sample_rows:
                return [None] * len(batch.items)
            logits = self.model.compute_logits(hidden[self._tensor(h.logits_indices, torch.int64)])
        seqs = [batch.items[row].seq for row in h.sample_rows]
        results: list[SampledToken | None] = [None] * len(batch.items)
        for row, token in zip(h.sample_rows, self.sample(logits, seqs), strict=True):
            results[row] = token
        return results

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        inputs = SamplingInputs(
            params=[s.params for s in seqs],
            prompt_token_ids=[s.prompt_token_ids for s in seqs],
            output_token_ids=[s.output_token_ids for s in seqs],
            eos_token_ids=[self.eos_token_ids] * len(seqs),
            request_ids=[s.request_id for s in seqs],
        )
        plan = self.sampler.plan(inputs, tuple(logits.shape))
        out = to_host(self.sampler.sample(logits, plan), plan)
        return [
            SampledToken(
                token_id=out.token_ids[i],
                logprob=out.logprobs[i] if out.logprobs is not None else None,
                top_logprobs=out.top_logprobs[i] if out.top_logprobs is not None else None,
            )
            for i in range(len(seqs))
        ]
