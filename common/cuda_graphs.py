"""CUDA-graph capture and replay of decode steps: one graph per batch size, static buffers here.

A decode step (every row: one query token that samples) is captured once per size in
`capture_sizes(max_num_seqs)`; a smaller batch is padded to the next captured size. The graph
bakes in pointers and launch grids, so everything it reads changes only by value inside the
static buffers below. Padding rows: token 0 at position 0, KV written to the pool's padding
slot, context length 1 (block 0, read but ignored), so no data-dependent branch is needed.

Contract with attention backends: their decode path may use only shapes and
`metadata.max_seq_len` (fixed here at the model's context limit) on the host; per-row lengths
must be read from `metadata.seq_lens` on the device.
"""

from __future__ import annotations

import logging

import torch

from common.attention import AttentionBackend, AttentionMetadata, ForwardContext
from common.kv_cache import KVCache
from common.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        kv_cache: KVCache,
        max_num_seqs: int,
        max_model_len: int,
        scale: float,
    ) -> None:
        self.model, self.backend, self.kv_cache, self.scale = model, backend, kv_cache, scale
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        device = kv_cache.pool.device
        n = self.max_batch
        self.max_blocks = -(-max_model_len // kv_cache.block_size)
        # ids, positions, slots and context lengths live in one int64 buffer, filled by one copy.
        self._vectors = torch.zeros(4, n, dtype=torch.int64, device=device)
        self._vectors[2] = kv_cache.padding_slot
        self._vectors[3] = 1
        self.input_ids, self.positions, self.slot_mapping = (
            self._vectors[0],
            self._vectors[1],
            self._vectors[2],
        )
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self._stage = torch.zeros(4, n, dtype=torch.int64, pin_memory=True)
        self._table_stage = torch.zeros(n, self.max_blocks, dtype=torch.int32, pin_memory=True)
        self._table_np = self._table_stage.numpy()  # same memory, cheap row writes
        self._row_keys: list[object] = [None] * n
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            slot_mapping=self.slot_mapping[:bs],
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[self.max_model_len] * bs,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        self.seq_lens[:bs].copy_(self._vectors[3, :bs])  # int64 -> int32, captured with the step
        ctx = ForwardContext(
            self.backend,
            self._metadata(bs),
            self.kv_cache.k_caches,
            self.kv_cache.v_caches,
            self.scale,
        )
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], ctx)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every size (largest first, sharing one memory pool); returns bytes used."""
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for bs in reversed(self.sizes):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(bs)  # warm-up: lazy init and autotuning stay out of the graph
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        used = torch.cuda.memory_reserved() - before
        log.info(
            "captured %d decode graphs (batch sizes %s), %.1f MiB",
            len(self.sizes),
            self.sizes,
            used / 2**20,
        )
        return used

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch

    @torch.inference_mode()
    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        row_keys: list[object],
    ) -> torch.Tensor:
        """Replay the graph of the smallest captured size >= len(input_ids); logits [n, vocab].

        `row_keys[i]` must change whenever row i's block list changes other than by growing
        (a different sequence, or the same one after preemption): equal key and length means
        the staged row is still right and is not rewritten."""
        n = len(input_ids)
        bs = next(s for s in self.sizes if s >= n)
        width = max(len(row) for row in block_tables)
        # One pinned staging buffer, one copy: [ids, positions, slots, seq_lens] then the table.
        stage = self._stage
        stage[0, :n] = torch.tensor(input_ids)
        stage[1, :n] = torch.tensor(positions)
        stage[2, :n] = torch.tensor(slots)
        stage[3, :n] = torch.tensor(seq_lens)
        if bs > n:  # padding rows (see module docstring)
            stage[0:2, n:bs] = 0
            stage[2, n:bs] = self.kv_cache.padding_slot
            stage[3, n:bs] = 1
        table = self._table_np
        for i, row in enumerate(block_tables):
            # A running sequence keeps its row and grows one block every block_size steps:
            # rewrite a row only when its owner or length changed.
            key = row_keys[i]
            if self._row_keys[i] != key:
                self._row_keys[i] = key
                table[i, : len(row)] = row
        if bs > n:
            table[n:bs, 0] = 0
            self._row_keys[n:bs] = [None] * (bs - n)
        table = self._table_stage[:bs, :width]
        self._vectors[:, :bs].copy_(stage[:, :bs], non_blocking=True)
        self.block_tables[:bs, :width].copy_(table, non_blocking=True)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
