"""Flat token rows over a proposer's own paged KV pool (the draft model's, the EAGLE-3 head's).

Such a pool has the target pool's number of blocks and block size and is addressed with the
target sequence's block ids: position p of a sequence sits at the same slot in both pools. The
scheduler has given a speculating sequence blocks for its last token plus its draft limit, so
the proposer needs no allocator; it must not write a position past those blocks (`add` checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.engine.device_copy import to_device
from common.engine.kv_cache import KVCache
from common.engine.scheduler import ScheduledBatch
from common.engine.sequence import Sequence
from common.model.attention import AttentionBackend, AttentionMetadata, ForwardContext


def drafting_rows(batch: ScheduledBatch, limits: list[int]) -> list[int]:
    """The batch items that draft, longest limit first: the sequences still drafting at each
    draft step are then a prefix of them. ValueError when `limits` does not fit the batch."""
    if len(limits) != len(batch.items):
        raise ValueError(f"{len(limits)} limits for {len(batch.items)} batch items")
    return sorted((i for i, k in enumerate(limits) if k > 0), key=lambda i: -limits[i])


def draft_blocks(seq: Sequence, limit: int, block_size: int) -> list[int]:
    """`seq`'s block ids, which must hold its last token and `limit` drafts (ValueError)."""
    needed = -(-(seq.num_tokens + limit) // block_size)
    if len(seq.block_ids) < needed:
        raise ValueError(
            f"request {seq.request_id!r} drafts {limit} tokens after {seq.num_tokens} and "
            f"needs {needed} blocks; it holds {len(seq.block_ids)}"
        )
    return seq.block_ids


@dataclass
class PagedRows:
    """One forward's rows: sequence i feeds `query_lens[i]` tokens that end its context of
    `seq_lens[i]` positions (the earlier ones are read from the pool)."""

    block_size: int
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    last_rows: list[int] = field(default_factory=list)  # each sequence's last token row
    row_keys: list[tuple] = field(default_factory=list)  # decode rows: see DecodeGraphs.launch

    def add(self, tokens: list[int], start: int, block_ids: list[int]) -> None:
        """A sequence's `tokens` at positions `start`, `start + 1`, ..., one query."""
        end = self._check(tokens, start, block_ids)
        self._extend(tokens, start, block_ids)
        self.query_lens.append(len(tokens))
        self.seq_lens.append(end)
        self.block_tables.append(block_ids)

    def add_decode_rows(
        self, tokens: list[int], start: int, block_ids: list[int], key: tuple
    ) -> None:
        """The same tokens as decode rows (query length 1 each, row j attending to the
        positions up to start + j, written by the same forward), as the runner's verify rows:
        a graph of decode steps runs them. `key` names the sequence's block list."""
        self._check(tokens, start, block_ids)
        self._extend(tokens, start, block_ids)
        for j in range(len(tokens)):
            self.query_lens.append(1)
            self.seq_lens.append(start + j + 1)
            self.block_tables.append(block_ids)
            self.row_keys.append((*key, j))

    def _check(self, tokens: list[int], start: int, block_ids: list[int]) -> int:
        bs, end = self.block_size, start + len(tokens)
        if not tokens or end > len(block_ids) * bs:
            raise ValueError(
                f"rows for positions {start}..{end - 1} need {-(-end // bs)} blocks, "
                f"the sequence holds {len(block_ids)}"
            )
        return end

    def _extend(self, tokens: list[int], start: int, block_ids: list[int]) -> None:
        bs, end = self.block_size, start + len(tokens)
        self.input_ids.extend(tokens)
        self.positions.extend(range(start, end))
        self.slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
        self.last_rows.append(len(self.input_ids) - 1)

    @property
    def num_rows(self) -> int:
        return len(self.input_ids)

    def metadata(self, device: torch.device) -> AttentionMetadata:
        width = max(len(t) for t in self.block_tables)
        cum = [0]
        for n in self.query_lens:
            cum.append(cum[-1] + n)
        return AttentionMetadata(
            query_start_loc=to_device(cum, torch.int32, device),
            seq_lens=to_device(self.seq_lens, torch.int32, device),
            block_tables=to_device(
                [t + [0] * (width - len(t)) for t in self.block_tables], torch.int32, device
            ),
            slot_mapping=to_device(self.slots, torch.int64, device),
            query_lens_cpu=self.query_lens,
            seq_lens_cpu=self.seq_lens,
            max_query_len=max(self.query_lens),
            max_seq_len=max(self.seq_lens),
        )


@dataclass
class ProposerPool:
    """A proposer's KV pool and the backend that attends over it."""

    kv_cache: KVCache
    backend: AttentionBackend
    device: torch.device
    scale: float  # the softmax scale (`ModelSpec.attention_scale`)

    def inputs(self, rows: PagedRows) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """(input ids, positions, context) of one eager forward over `rows`."""
        kv = self.kv_cache
        ctx = ForwardContext(
            self.backend,
            rows.metadata(self.device),
            kv.k_caches,
            kv.v_caches,
            self.scale,
            **kv.context_kwargs(),
        )
        ids = to_device(rows.input_ids, torch.int64, self.device)
        return ids, to_device(rows.positions, torch.int64, self.device), ctx

    def last_rows(self, rows: PagedRows) -> torch.Tensor:
        """Each sequence's last row index, on the device."""
        return to_device(rows.last_rows, torch.int64, self.device)
