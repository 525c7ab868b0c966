"""Vocab-parallel embedding and LM head (`common.model.parallel`: rank r owns vocabulary rows
`layout.vocab(r)`; every rank's weight has `vocab_per_rank` rows, the last rank's padded with
rows no token id reaches and whose logits are cut off after the gather).

With one rank both are the plain layers: a lookup, and one matmul into the logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.model.distributed import TPGroup
from common.model.layers.weights import copy_checked
from common.model.parallel import TPLayout


class VocabParallel(nn.Module):
    """This rank's `layout.vocab_per_rank` rows of a [vocab, hidden] table."""

    def __init__(self, layout: TPLayout, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, layout.vocab_size
        self.rows = layout.vocab(tp.rank)
        self.start = tp.rank * layout.vocab_per_rank  # = rows.start unless all padding
        self.weight = nn.Parameter(torch.empty(layout.vocab_per_rank, hidden_size))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        """This rank's rows of the full table; padding rows are zeros."""
        if shard_id is not None:
            raise ValueError(f"is not fused, got shard {shard_id}")
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"has {loaded.shape[0]} rows, expected {self.vocab_size}")
        n = len(self.rows)
        copy_checked(param.data[:n], loaded[self.rows.start : self.rows.stop])
        param.data[n:].zero_()


class VocabParallelEmbedding(VocabParallel):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids outside this rank's rows look up row 0 and are zeroed; the all-reduce then sums
        # exactly one non-zero row per token, the owner's.
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallel):
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """float32 [rows, vocab_size] logits on every rank, into `out` when given."""
        if self.tp.size == 1:
            if out is None:
                return F.linear(hidden, self.weight).float()
            if self.weight.dtype == torch.float32:
                return torch.mm(hidden, self.weight.t(), out=out)
            return out.copy_(F.linear(hidden, self.weight))  # the cast is the copy
        logits = self.tp.gather_columns(F.linear(hidden, self.weight))[:, : self.vocab_size]
        if out is None:
            return logits.float()
        return out.copy_(logits)
