"""CUDA graphs of the EAGLE-3 head's step over decode rows: one graph per batch size, static
buffers here, as `DecodeGraphs` for a model (padding rows, the shared memory pool, the
backends' decode contract; on CPU nothing is captured and the same forward runs on the same
buffers).

A step reads input ids, positions, the head's hidden-size input rows, slots, context lengths
and block tables, and leaves each row's greedy draft (a target id) and its `prenorm` state in
static outputs. `launch` stages rows from the host (page-locked copies, no staging ring: no
buffer here is rewritten by the host); `advance` feeds each row's outputs back as its next
inputs one position on, on the device, for the single-token draft steps.
"""

from __future__ import annotations

import logging

import torch

from common.engine.cuda_graphs import advance_rows, capture_sizes
from common.engine.device_copy import to_device
from common.engine.spec_decode.paged import PagedRows, ProposerPool
from common.model.attention import AttentionMetadata, ForwardContext
from common.model.eagle3 import Eagle3Head

log = logging.getLogger(__name__)


class HeadGraphs:
    def __init__(
        self, head: Eagle3Head, pool: ProposerPool, max_rows: int, max_model_len: int
    ) -> None:
        self.head, self.pool, self.max_model_len = head, pool, max_model_len
        kv = pool.kv_cache
        self.sizes = capture_sizes(max_rows)
        self.max_batch = n = self.sizes[-1]
        device = pool.device
        self.on_cuda = device.type == "cuda"
        self.max_blocks = -(-max_model_len // kv.block_size)
        self._vectors = torch.zeros(4, n, dtype=torch.int64, device=device)
        self._vectors[2] = kv.padding_slot
        self._vectors[3] = 1
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        width, dtype = head.spec.layer.hidden_size, head.fc.weight.dtype
        self.hidden = torch.zeros(n, width, dtype=dtype, device=device)
        self.prenorm = torch.zeros(n, width, dtype=dtype, device=device)
        self.token_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.launches = 0

    def fits(self, rows: int) -> bool:
        return rows <= self.max_batch

    def padded_size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def _forward(self, bs: int) -> None:
        v, kv = self._vectors, self.pool.kv_cache
        self.seq_lens[:bs].copy_(v[3, :bs])
        metadata = AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            slot_mapping=v[2, :bs],
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[self.max_model_len] * bs,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )
        ctx = ForwardContext(self.pool.backend, metadata, kv.k_caches, kv.v_caches,
                             self.pool.scale, **kv.context_kwargs())  # fmt: skip
        normed, prenorm = self.head(v[0, :bs], v[1, :bs], self.hidden[:bs], ctx)
        self.prenorm[:bs].copy_(prenorm)
        draft = self.head.compute_logits(normed).argmax(dim=-1)
        self.token_ids[:bs].copy_(self.head.to_target(draft))

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every size (largest first, one memory pool); returns bytes used. On CPU
        nothing is captured."""
        if not self.on_cuda:
            return 0
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for bs in reversed(self.sizes):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(bs)  # warm-up outside the graph
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        used = torch.cuda.memory_reserved() - before
        log.info("captured %d EAGLE-3 head graphs (batch sizes %s), %.1f MiB", len(self.sizes),
                 self.sizes, used / 2**20)  # fmt: skip
        return used

    @torch.inference_mode()
    def launch(
        self, rows: PagedRows, hidden: torch.Tensor, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run decode `rows` (query length 1 each) fed `hidden` [rows, H] and `ids` (device;
        default `rows.input_ids`); (each row's draft, its prenorm), views of the outputs."""
        n = rows.num_rows
        assert all(q == 1 for q in rows.query_lens) and n == len(hidden), "decode rows only"
        bs = self.padded_size(n)
        pad = bs - n
        vectors = [
            rows.input_ids + [0] * pad,
            rows.positions + [0] * pad,
            rows.slots + [self.pool.kv_cache.padding_slot] * pad,
            rows.seq_lens + [1] * pad,
        ]
        width = max(len(t) for t in rows.block_tables)
        table = [t + [0] * (width - len(t)) for t in rows.block_tables] + [[0] * width] * pad
        self._vectors[:, :bs].copy_(to_device(vectors, torch.int64, self.pool.device))
        self.block_tables[:bs, :width].copy_(to_device(table, torch.int32, self.pool.device))
        if ids is not None:
            self._vectors[0, :n].copy_(ids)
        self.hidden[:n].copy_(hidden)
        return self._replay(n, bs)

    @torch.inference_mode()
    def advance(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `n` rows of the last step one position on, each fed its own draft and
        prenorm (see `advance_rows`); the rest become padding."""
        bs = self.padded_size(n)
        kv = self.pool.kv_cache
        advance_rows(self._vectors, self.block_tables, n, bs, kv.block_size, kv.padding_slot)
        self._vectors[0, :n].copy_(self.token_ids[:n])
        self.hidden[:n].copy_(self.prenorm[:n])
        return self._replay(n, bs)

    def _replay(self, n: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.on_cuda:
            self.graphs[bs].replay()
        else:
            self._forward(bs)
        self.launches += 1
        return self.token_ids[:n], self.prenorm[:n]
