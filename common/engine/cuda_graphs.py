"""CUDA-graph capture and replay of decode steps: one graph per batch size, static buffers here.

A batch is padded to the next size of `capture_sizes`; padding rows (token 0, position 0, KV to
the pool's padding slot, context length 1, a plain row of `decode_groups`) need no
data-dependent branch. With `rows_max` > 1 (speculation: K + 1) each size is captured twice:
steps with a verify run replay graphs that pass `decode_groups` to attention (a verify step's
rows of one sequence read its KV once), the others the plain launch. All sizes share one
float32 `logits` buffer, so graph memory does not grow with the number of sizes. Inputs go
through a `StagingRing` of pinned host buffers: with the overlapped loop step N+1 is staged
before step N may have run, so a buffer is rewritten only after its step was observed complete
(`StepHandle.result`), else `StagingHazard`. On CPU nothing is captured; the same padded forward
runs on the same buffers, so the path is testable without a GPU.

Pipeline stages capture their own layers: a stage after the first reads the (hidden,
residual) carry the stage before sent, copied into static `carry_in` buffers before a replay;
a stage before the last ends with its carry in static `carry_out` buffers instead of logits.

Contract with attention backends: their decode path may use only shapes and
`metadata.max_seq_len` (fixed here at the model's context limit) on the host; per-row lengths
must be read from `metadata.seq_lens` on the device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from common.engine.kv_cache import KVCache
from common.model.attention import AttentionBackend, AttentionMetadata, ForwardContext
from common.model.graph_capture import recording_graphs
from common.model.registry import CausalLM

log = logging.getLogger(__name__)

STAGING_DEPTH = 2  # one step being staged while one is in flight


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


def advance_rows(
    vectors: torch.Tensor, block_tables: torch.Tensor, n: int, bs: int, block_size: int,
    padding_slot: int,
) -> None:  # fmt: skip
    """Move staged decode rows [ids, positions, slots, context lengths] one position on, on
    the device: rows 0..n-1 (their block tables hold the next position) advance, rows n..bs-1
    become padding. The ids are the caller's to write."""
    positions = vectors[1, :n]
    positions += 1
    vectors[3, :n] += 1
    blocks = block_tables[:n].gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
    vectors[2, :n] = blocks * block_size + positions % block_size
    if bs > n:
        vectors[0:2, n:bs] = 0
        vectors[2, n:bs] = padding_slot
        vectors[3, n:bs] = 1


class StagingHazard(RuntimeError):
    """A staging buffer was about to be rewritten while a step that reads it may still run."""


@dataclass
class StagingSlot:
    """Host buffers for one step's inputs: [ids, positions, slots, seq_lens, groups] and the
    block table, pinned on CUDA. `generation` counts writes; `completed` is the last generation whose
    step was observed complete. Rewriting is legal only when they are equal."""

    vectors: torch.Tensor  # [5, max_rows] int64
    table: torch.Tensor  # [max_rows, max_blocks] int32
    row_keys: list[object] = field(default_factory=list)
    generation: int = 0
    completed: int = 0

    def release(self, generation: int) -> None:
        self.completed = max(self.completed, generation)


class StagingRing:
    def __init__(self, depth: int, rows: int, columns: int, pinned: bool) -> None:
        self.slots = [
            StagingSlot(
                torch.zeros(5, rows, dtype=torch.int64, pin_memory=pinned),
                torch.zeros(rows, columns, dtype=torch.int32, pin_memory=pinned),
                [None] * rows,
            )
            for _ in range(depth)
        ]
        self._next = 0

    def acquire(self) -> tuple[StagingSlot, int]:
        """The next slot and the generation its reader must release; StagingHazard if the
        previous step that read this slot has not been observed complete."""
        slot = self.slots[self._next]
        if slot.completed != slot.generation:
            raise StagingHazard(
                f"staging slot {self._next} rewritten while generation {slot.generation} may "
                f"still be read (completed: {slot.completed}); more steps in flight than "
                f"{len(self.slots)} staging slots"
            )
        self._next = (self._next + 1) % len(self.slots)
        slot.generation += 1
        return slot, slot.generation


@dataclass
class Replay:
    """One launched graph step: its output rows (logits, or hidden states for prefill graphs)
    and the staging slot its reader releases."""

    output: torch.Tensor
    slot: StagingSlot
    generation: int
    # The target's auxiliary hidden states of the step's rows, when the model keeps them
    # (EAGLE-3: `LlamaModel.aux_hidden_layers`).
    aux_hidden: torch.Tensor | None = None
    # A pipeline stage before the last: its (hidden, residual) rows for the next stage, in
    # static buffers the next replay rewrites.
    carry: tuple[torch.Tensor, torch.Tensor] | None = None

    def release(self) -> None:
        self.slot.release(self.generation)


def carry_buffers(model: CausalLM, rows: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Static (hidden, residual) rows exchanged with a neighbouring pipeline stage."""
    shape = (rows, model.spec.hidden_size)
    return tuple(torch.zeros(shape, dtype=model.dtype, device=device) for _ in range(2))


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        kv_cache: KVCache,
        max_num_seqs: int,
        max_model_len: int,
        scale: float,
        rows_max: int = 1,
    ) -> None:
        if rows_max < 1:
            raise ValueError(f"rows_max must be >= 1, got {rows_max}")
        self.model, self.backend, self.kv_cache, self.scale = model, backend, kv_cache, scale
        self.max_model_len = max_model_len
        self.rows_max = rows_max  # fixed at capture: the attention launch depends on it
        self.sizes = capture_sizes(max_num_seqs)
        self.max_batch = n = self.sizes[-1]
        device = kv_cache.pool.device
        self.on_cuda = device.type == "cuda"
        self.max_blocks = -(-max_model_len // kv_cache.block_size)
        # ids, positions, slots, context lengths and groups live in one int64 buffer, filled
        # by one copy.
        self._vectors = torch.zeros(5, n, dtype=torch.int64, device=device)
        self._vectors[2] = kv_cache.padding_slot
        self._vectors[3:5] = 1
        self.input_ids, self.positions, self.slot_mapping = self._vectors[:3]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.groups = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        stage = model.stage
        vocab = model.spec.vocab_size if stage.is_last else 0
        self.logits = torch.zeros(n, vocab, dtype=torch.float32, device=device)
        self.carry_in = None if stage.is_first else carry_buffers(model, n, device)
        self.carry_out = None if stage.is_last else carry_buffers(model, n, device)
        self.staging = StagingRing(STAGING_DEPTH, n, self.max_blocks, pinned=self.on_cuda)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # plain decode steps
        self.grouped_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # steps with a verify run
        self._aux: dict[tuple[int, bool], torch.Tensor | None] = {}
        self.launches = 0  # steps served (tests and benchmarks read it)

    def _metadata(self, bs: int, grouped: bool) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            slot_mapping=self.slot_mapping[:bs],
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[self.max_model_len] * bs,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            decode_groups=self.groups[:bs] if grouped else None,
            decode_rows_max=self.rows_max if grouped else 1,
        )

    def _forward(self, bs: int, grouped: bool = False) -> torch.Tensor:
        self.seq_lens[:bs].copy_(self._vectors[3, :bs])  # int64 -> int32, captured with the step
        if grouped:
            self.groups[:bs].copy_(self._vectors[4, :bs])
        ctx = ForwardContext(
            self.backend,
            self._metadata(bs, grouped),
            self.kv_cache.k_caches,
            self.kv_cache.v_caches,
            self.scale,
            **self.kv_cache.context_kwargs(),
        )
        carry = None if self.carry_in is None else tuple(t[:bs] for t in self.carry_in)
        out = self.model(self.input_ids[:bs], self.positions[:bs], ctx, carry)
        # A captured graph rewrites the same aux tensor at every replay of this size.
        self._aux[bs, grouped] = getattr(self.model.model, "aux_hidden", None)
        if self.carry_out is not None:
            for buffer, t in zip(self.carry_out, out, strict=True):
                buffer[:bs].copy_(t)
            return self.carry_out[0][:bs]
        return self.model.compute_logits(out, out=self.logits[:bs])

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every size (largest first, sharing one memory pool); returns bytes used.
        On a CPU device nothing is captured (replays run the forward directly)."""
        if not self.on_cuda:
            return 0
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        # With rows_max > 1 every size is captured twice: the grouped attention launch (tiles
        # of rows_max x GROUP rows) made plain steps 6-12% slower on an H200, so steps without
        # a verify run replay the plain launch.
        for grouped in (False, True) if self.rows_max > 1 else (False,):
            graphs = self.grouped_graphs if grouped else self.graphs
            for bs in reversed(self.sizes):
                with recording_graphs():  # the kernels' PDL launches (kernels/pdl.py)
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        self._forward(bs, grouped)  # warm-up: lazy init, compiles, out of graph
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._forward(bs, grouped)
                graphs[bs] = graph
        torch.cuda.synchronize()
        used = torch.cuda.memory_reserved() - before + self.logits.numel() * 4
        log.info(
            "captured %d decode graphs (batch sizes %s), %.1f MiB with the shared logits",
            len(self.sizes),
            self.sizes,
            used / 2**20,
        )
        return used

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch

    def padded_size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    @torch.inference_mode()
    def launch(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        row_keys: list[object],
        fill_ids: tuple[torch.Tensor, torch.Tensor] | None = None,
        groups: list[int] | None = None,
        carry: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Replay:
        """Stage one decode step and replay the graph of the smallest captured size >= its
        rows; the Replay's logits are [n, vocab] rows of the shared buffer.

        `row_keys[i]` must change whenever row i's block list changes other than by growing
        (a different sequence, or the same one after preemption): equal key and length means
        the staged row is still right and is not rewritten. `fill_ids` (token positions,
        device token ids) overwrites staged ids on the device after the copy: tokens sampled
        by a step whose results are not on the host yet. `groups`: the rows' `decode_groups`
        (runs of at most `rows_max` rows; None: every row plain). `carry`: a later pipeline
        stage's input rows; a stage before the last returns its carry in `Replay.carry`."""
        n = len(input_ids)
        bs = self.padded_size(n)
        slot, generation = self.staging.acquire()
        if carry is not None:
            for buffer, t in zip(self.carry_in, carry, strict=True):
                buffer[:n].copy_(t)
        try:
            grouped = self._stage_and_replay(
                slot, bs, input_ids, positions, slots, seq_lens, block_tables, row_keys, fill_ids,
                groups,
            )  # fmt: skip
        except BaseException:
            if self.on_cuda:
                torch.cuda.synchronize()  # nothing may still read the slot we give back
            slot.release(generation)
            raise
        self.launches += 1
        aux = self._aux.get((bs, grouped))
        if self.carry_out is not None:
            hidden, residual = (t[:n] for t in self.carry_out)
            return Replay(hidden, slot, generation, carry=(hidden, residual))
        return Replay(self.logits[:n], slot, generation, None if aux is None else aux[:n])

    @torch.inference_mode()
    def advance(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Replay the first n = len(`input_ids`) rows of the last `launch` one position further
        on, fed `input_ids` (device); see `advance_rows`. No staging slot is taken and the
        host reads nothing: a drafter's single-token steps, whose rows only shrink (a prefix)
        as their draft limits run out. Returns [n, vocab] logits rows of the shared buffer."""
        n = len(input_ids)
        bs = self.padded_size(n)
        advance_rows(self._vectors, self.block_tables, n, bs, self.kv_cache.block_size,
                     self.kv_cache.padding_slot)  # fmt: skip
        self._vectors[4, :bs] = 1  # single-token rows, each its own run
        self.input_ids[:n].copy_(input_ids)
        if self.on_cuda:
            self.graphs[bs].replay()
        else:
            self._forward(bs)
        self.launches += 1
        return self.logits[:n]

    def _stage_and_replay(
        self, slot: StagingSlot, bs: int, input_ids, positions, slots, seq_lens, block_tables,
        row_keys, fill_ids, groups,
    ) -> bool:  # fmt: skip
        """Returns whether the step replayed the grouped launch (it has a verify run)."""
        n = len(input_ids)
        width = max(len(row) for row in block_tables)
        stage = slot.vectors
        # Through numpy (same memory): converting the lists is several times cheaper there.
        stage.numpy()[:4, :n] = [input_ids, positions, slots, seq_lens]
        grouped = self.rows_max > 1 and groups is not None and max(groups) > 1
        if not grouped:  # attention reads no groups then
            stage[4, :n] = 1
        elif max(groups) > self.rows_max:
            raise ValueError(f"a run of {max(groups)} rows; these graphs group {self.rows_max}")
        else:
            stage.numpy()[4, :n] = groups
        if bs > n:  # padding rows (see module docstring)
            stage[0:2, n:bs] = 0
            stage[2, n:bs] = self.kv_cache.padding_slot
            stage[3:5, n:bs] = 1
        self._stage_table(slot, block_tables, row_keys, n, bs)
        self._vectors[:, :bs].copy_(stage[:, :bs], non_blocking=True)
        self.block_tables[:bs, :width].copy_(slot.table[:bs, :width], non_blocking=True)
        if fill_ids is not None:
            at, ids = fill_ids
            self.input_ids.index_copy_(0, at, ids)
        if self.on_cuda:
            (self.grouped_graphs if grouped else self.graphs)[bs].replay()
        else:
            self._forward(bs, grouped)
        return grouped

    @staticmethod
    def _stage_table(
        slot: StagingSlot, block_tables: list[list[int]], keys: list[object], n: int, bs: int
    ) -> None:
        table = slot.table.numpy()  # same memory, cheap row writes
        last, values = None, None
        for i, row in enumerate(block_tables):
            # A running sequence keeps its row and grows one block every block_size steps:
            # rewrite a row only when its owner or length changed.
            if slot.row_keys[i] != keys[i]:
                slot.row_keys[i] = keys[i]
                if row is not last:  # a verify step's rows of one sequence share its list
                    last, values = row, np.asarray(row, dtype=np.int32)
                table[i, : len(values)] = values
        if bs > n:
            table[n:bs, 0] = 0
            slot.row_keys[n:bs] = [None] * (bs - n)
