"""Tensor-parallel linear layers that own their weights (Megatron-style; `common.model.parallel`).

A column-parallel layer holds a slice of the output rows and needs no communication; several
checkpoint tensors may be stacked into its one weight (q/k/v, gate/up), each an
`OutputShard`. A row-parallel layer holds a slice of the input columns and all-reduces its
partial sums. Every parameter's `weight_loader` cuts this rank's slice out of a full
checkpoint tensor (`common.model.layers.weights`); the matmul itself belongs to the layer's
`LinearMethod`. With one rank every slice is the whole tensor and the collectives are no-ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from common.model.distributed import TPGroup
from common.model.layers.weights import copy_checked
from common.model.parallel import TPLayout
from common.model.quantization import LinearMethod, UnquantizedLinearMethod
from common.model.quantization.activation import ActivationQuant, Fp8Activation


@dataclass(frozen=True)
class OutputShard:
    """One checkpoint tensor stacked in a column-parallel weight: `full` rows in the
    checkpoint, of which this rank holds `rows`."""

    full: int
    rows: range


def even_split(size: int, tp: TPGroup) -> range:
    """Rank `tp.rank`'s part of `size` units split evenly over the ranks."""
    if size % tp.size:
        raise ValueError(f"tp={tp.size} does not divide size {size}")
    n = size // tp.size
    return range(tp.rank * n, (tp.rank + 1) * n)


class LinearBase(nn.Module):
    def __init__(self, tp: TPGroup, method: LinearMethod | None) -> None:
        super().__init__()
        self.tp = tp
        self.method = method or UnquantizedLinearMethod()

    @property
    def input_quant(self) -> ActivationQuant | None:
        """The FP8 layout this layer's input may come in (`LinearMethod.input_quant`)."""
        return self.method.input_quant(self)

    def _add_bias(self, size: int, bias: bool) -> None:
        if not bias:
            self.register_parameter("bias", None)
            return
        self.bias = nn.Parameter(torch.empty(size))
        self.bias.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        raise NotImplementedError


class ColumnParallelBase(LinearBase):
    """Output rows sharded: the weight stacks this rank's rows of each `OutputShard`, in order."""

    def __init__(
        self,
        input_size: int,
        shards: list[OutputShard],
        tp: TPGroup,
        bias: bool,
        method: LinearMethod | None,
    ) -> None:
        super().__init__(tp, method)
        self.shards = shards
        self.output_sizes = [len(s.rows) for s in shards]  # this rank's rows per shard
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(shards))]
        self.method.create_weights(self, input_size, self.output_sizes, self.weight_loader)
        self._add_bias(sum(self.output_sizes), bias)

    def forward(
        self, x: torch.Tensor | Fp8Activation, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`out`: where the output goes, as `LinearMethod.apply` (no collective follows a
        column-parallel layer, so it is the layer's output as it stands)."""
        return self.method.apply(self, x, self.bias, out)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        """Weight and bias alike: output rows are dim 0. `shard_id` None with several shards
        is the whole fused tensor (dummy weights drawn in our names), split at the full sizes."""
        if shard_id is None and len(self.shards) > 1:
            fulls = [s.full for s in self.shards]
            if loaded.shape[0] != sum(fulls):
                raise ValueError(f"has {loaded.shape[0]} rows, expected {sum(fulls)} (fused)")
            for i, part in enumerate(loaded.split(fulls)):
                self.weight_loader(param, part, i)
            return
        if shard_id is None:
            shard_id = 0
        if not 0 <= shard_id < len(self.shards):
            raise ValueError(f"has no shard {shard_id} (it fuses {len(self.shards)})")
        shard = self.shards[shard_id]
        if loaded.shape[0] != shard.full:
            raise ValueError(f"has {loaded.shape[0]} rows, expected {shard.full}")
        rows = shard.rows
        dst = param.data.narrow(0, self.offsets[shard_id], len(rows))
        copy_checked(dst, loaded.narrow(0, rows.start, len(rows)))


class ColumnParallelLinear(ColumnParallelBase):
    """Output rows split evenly over the ranks; one checkpoint tensor."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp: TPGroup,
        bias: bool = False,
        method: LinearMethod | None = None,
    ) -> None:
        shards = [OutputShard(output_size, even_split(output_size, tp))]
        super().__init__(input_size, shards, tp, bias, method)


class MergedColumnParallelLinear(ColumnParallelBase):
    """Several column-parallel outputs in one matmul (gate/up), each split evenly."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        tp: TPGroup,
        bias: bool = False,
        method: LinearMethod | None = None,
    ) -> None:
        shards = [OutputShard(n, even_split(n, tp)) for n in output_sizes]
        super().__init__(input_size, shards, tp, bias, method)


class QKVParallelLinear(ColumnParallelBase):
    """q, k and v (shards 0, 1, 2) by heads: this rank's query heads and the KV heads
    `layout.kv_heads(rank)` names, which repeat on several ranks when there are fewer KV
    heads than ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        layout: TPLayout,
        tp: TPGroup,
        bias: bool = False,
        method: LinearMethod | None = None,
    ) -> None:
        q, kv = layout.q_heads(tp.rank), layout.kv_heads(tp.rank)
        q_rows = range(q.start * head_dim, q.stop * head_dim)
        kv_rows = range(kv.start * head_dim, kv.stop * head_dim)
        kv_full = layout.num_kv_heads * head_dim
        shards = [
            OutputShard(layout.num_heads * head_dim, q_rows),
            OutputShard(kv_full, kv_rows),
            OutputShard(kv_full, kv_rows),
        ]
        super().__init__(hidden_size, shards, tp, bias, method)


class RowParallelLinear(LinearBase):
    """Input columns split evenly over the ranks; the partial sums are all-reduced through
    `tp` unless `reduce` is off (the caller reduces). The bias is whole on every rank and
    added by rank 0 only, so the sum holds it once."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp: TPGroup,
        bias: bool = False,
        reduce: bool = True,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__(tp, method)
        self.columns, self.reduce = even_split(input_size, tp), reduce
        self.method.create_weights(self, len(self.columns), [output_size], self.weight_loader)
        self._add_bias(output_size, bias)

    def forward(
        self, x: torch.Tensor | Fp8Activation, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`x` is this rank's input columns; FP8 scales of them are rank-local too. `out`: as
        `LinearMethod.apply` (the sum over ranks is taken there, in place)."""
        y = self.method.apply(self, x, self.bias if self.tp.rank == 0 else None, out)
        return self.tp.all_reduce(y) if self.reduce else y

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"is not fused, got shard {shard_id}")
        if param is self.bias:
            copy_checked(param.data, loaded)
            return
        full = len(self.columns) * self.tp.size
        if loaded.dim() != 2 or loaded.shape[1] != full:
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected {full} columns")
        copy_checked(param.data, loaded.narrow(1, self.columns.start, len(self.columns)))


def process_weights_after_loading(model: nn.Module) -> None:
    """Each linear layer's method gets its hook once every tensor is in place, and so does any
    other module with a `finish_loading` (the MoE layer's FP8 experts)."""
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.method.process_weights_after_loading(module)
        elif hasattr(module, "finish_loading"):
            module.finish_loading()
