"""Turns a ScheduledBatch into tensors, runs the model, samples one token per finishing row.

This is the only engine piece that touches torch besides the model and the backends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.attention import AttentionBackend, AttentionMetadata, ForwardContext
from common.kv_cache import KVCache
from common.models.llama import LlamaForCausalLM
from common.sampler import Sampler, SamplingInputs, make_generator, skip_draws
from common.scheduler import SampledToken, ScheduledBatch


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [rows that sample]
    sample_rows: list[int]  # batch item index of each sampling row


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
        self.sampler = Sampler()
        self.eos_token_ids = list(model.spec.eos_token_ids)
        self._generators: dict[str, torch.Generator | None] = {}
        self._k_caches = kv_cache.k_caches
        self._v_caches = kv_cache.v_caches

    def release(self, request_id: str) -> None:
        """Forget per-request state (its seeded generator) once the request has ended."""
        self._generators.pop(request_id, None)

    def resume_request(self, request_id: str, seed: int | None, sampled_elsewhere: int) -> None:
        """Set up a seeded request whose first tokens were sampled by another process."""
        generator = make_generator(seed, self.device)
        if generator is not None:
            skip_draws(generator, self.model.spec.vocab_size, self.device, sampled_elsewhere)
        self._generators[request_id] = generator

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sample_rows: list[int] = []
        for row, item in enumerate(batch.items):
            seq, start, n = item.seq, item.start, item.num_new_tokens
            tokens = seq.all_token_ids
            input_ids.extend(tokens[start : start + n])
            positions.extend(range(start, start + n))
            blocks = seq.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            if item.samples:
                logits_indices.append(len(input_ids) - 1)
                sample_rows.append(row)
        max_blocks = max(len(item.seq.block_ids) for item in batch.items)
        tables = [
            item.seq.block_ids + [0] * (max_blocks - len(item.seq.block_ids))
            for item in batch.items
        ]
        cum = [0]
        for n in query_lens:
            cum.append(cum[-1] + n)

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        metadata = AttentionMetadata(
            query_start_loc=tensor(cum, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=tensor(tables, torch.int32),
            slot_mapping=tensor(slots, torch.int64),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        return StepInputs(
            input_ids=tensor(input_ids, torch.int64),
            positions=tensor(positions, torch.int64),
            metadata=metadata,
            logits_indices=tensor(logits_indices, torch.int64),
            sample_rows=sample_rows,
        )

    @torch.inference_mode()
    def execute(
        self, batch: ScheduledBatch, on_layer_done: Callable[[int], None] | None = None
    ) -> list[SampledToken | None]:
        """Run one step; returns one entry per batch item (None where no token is sampled)."""
        inputs = self.prepare(batch)
        ctx = ForwardContext(
            self.backend, inputs.metadata, self._k_caches, self._v_caches, self.scale, on_layer_done
        )
        hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        results: list[SampledToken | None] = [None] * len(batch.items)
        if not inputs.sample_rows:
            return results
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        seqs = [batch.items[row].seq for row in inputs.sample_rows]
        sampling = SamplingInputs(
            params=[s.params for s in seqs],
            prompt_token_ids=[s.prompt_token_ids for s in seqs],
            output_token_ids=[s.output_token_ids for s in seqs],
            generators=[self._generator(s.request_id, s.params.seed) for s in seqs],
            eos_token_ids=[self.eos_token_ids] * len(seqs),
        )
        out = self.sampler(logits, sampling)
        for i, row in enumerate(inputs.sample_rows):
            results[row] = SampledToken(
                token_id=out.token_ids[i],
                logprob=out.logprobs[i] if out.logprobs is not None else None,
                top_logprobs=out.top_logprobs[i] if out.top_logprobs is not None else None,
            )
        return results

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if request_id not in self._generators:
            self._generators[request_id] = make_generator(seed, self.device)
        return self._generators[request_id]
