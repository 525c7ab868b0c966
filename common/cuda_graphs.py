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
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), kv_cache.padding_slot, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
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
        ctx = ForwardContext(
            self.backend, self._metadata(bs), self.kv_cache.k_caches, self.kv_cache.v_caches, self.scale
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
        log.info("captured %d decode graphs (batch sizes %s), %.1f MiB", len(self.sizes), self.sizes, used / 2**20)
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
    ) -> torch.Tensor:
        """Replay the graph of the smallest captured size >= len(input_ids); logits [n, vocab]."""
        n = len(input_ids)
        bs = next(s for s in self.sizes if s >= n)
        width = max(len(row) for row in block_tables)
        host = torch.tensor([input_ids, positions, slots, seq_lens], dtype=torch.int64)
        self.input_ids[:n].copy_(host[0], non_blocking=True)
        self.positions[:n].copy_(host[1], non_blocking=True)
        self.slot_mapping[:n].copy_(host[2], non_blocking=True)
        self.seq_lens[:n].copy_(host[3], non_blocking=True)
        table = torch.tensor([row + [0] * (width - len(row)) for row in block_tables], dtype=torch.int32)
        self.block_tables[:n, :width].copy_(table, non_blocking=True)
        if bs > n:  # padding rows (see module docstring)
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.slot_mapping[n:bs].fill_(self.kv_cache.padding_slot)
            self.seq_lens[n:bs].fill_(1)
            self.block_tables[n:bs, 0].zero_()
        self.graphs[bs].replay()
        return self.logits[bs][:n]
