"""Loaders of FP8 scale tensors: each cuts this rank's part of a FULL checkpoint scale, like
the layers' own weight loaders (contract in `common.model.layers.weights`).

They read the layer's sharding: a column-parallel layer has `shards` (each `OutputShard`:
`full` checkpoint rows, this rank's `rows`) stacked at `offsets`; a row-parallel one has
`columns`, this rank's input columns of `len(columns) * tp.size`.
"""

from __future__ import annotations

import torch
from torch import nn

from common.model.layers.weights import copy_checked
from common.model.quantization.base import WeightLoader


def is_column_parallel(layer: nn.Module) -> bool:
    return hasattr(layer, "shards")


def per_row_loader(layer: nn.Module) -> WeightLoader:
    """Per-channel scales [N, 1]: sliced with the output rows of a column-parallel layer (its
    own loader does that); whole on a row-parallel one, whose output rows are all here."""
    if is_column_parallel(layer):
        return layer.weight_loader
    return whole_loader


def whole_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
    if shard_id is not None:
        raise ValueError(f"is not fused, got shard {shard_id}")
    copy_checked(param.data, loaded)


def per_shard_scalar_loader(
    param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
) -> None:
    """One scalar per checkpoint tensor (per-tensor `weight_scale`, `input_scale`), stored at
    its shard's index of a [num_shards] parameter; shape [] and [1] both occur."""
    if loaded.numel() != 1:
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected one scale per tensor")
    if shard_id is None and param.numel() > 1:
        raise ValueError("is one scale for a fused tensor; expected one per checkpoint tensor")
    param.data[shard_id or 0] = loaded.reshape(()).float()


def block_range(rows: range, full: int, size: int, what: str) -> range:
    """The blocks of `size` that cover `rows` of `full`: the slice must start on a block
    boundary and end on one (or at the tensor's end, whose last block may be partial)."""
    if rows.start % size or (len(rows) % size and rows.stop != full):
        raise ValueError(
            f"{what} {rows.start}..{rows.stop} of {full} are not aligned to the {size}-wide "
            "FP8 weight blocks; choose a tensor-parallel size that splits on block boundaries"
        )
    return range(rows.start // size, -(-rows.stop // size))


class BlockScaleLoader:
    """Block scales [ceil(N / bn), ceil(K / bk)]. Column-parallel: each shard's block rows
    are stacked (this rank's rows / bn of them, an edge block per shard); row-parallel: the
    block columns of this rank's input columns. Alignment is checked when the layer is
    built (`check_alignment`), so a bad TP size fails at start, not mid-load."""

    def __init__(self, layer: nn.Module, block: tuple[int, int], output_size: int) -> None:
        self.layer, (self.bn, self.bk), self.output_size = layer, block, output_size

    def block_rows_per_shard(self) -> list[range]:
        if not is_column_parallel(self.layer):
            return [range(0, -(-self.output_size // self.bn))]
        return [block_range(s.rows, s.full, self.bn, "rows") for s in self.layer.shards]

    def block_columns(self, input_size: int) -> range:
        layer = self.layer
        if is_column_parallel(layer):
            return range(0, -(-input_size // self.bk))
        full = len(layer.columns) * layer.tp.size
        return block_range(layer.columns, full, self.bk, "input columns")

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None):
        layer = self.layer
        if loaded.dim() != 2:
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected 2-d block scales")
        if not is_column_parallel(layer):
            if shard_id is not None:
                raise ValueError(f"is not fused, got shard {shard_id}")
            full = len(layer.columns) * layer.tp.size
            cols = block_range(layer.columns, full, self.bk, "input columns")
            copy_checked(param.data, loaded[:, cols.start : cols.stop])
            return
        if shard_id is None and len(layer.shards) > 1:
            raise ValueError("is one scale tensor for a fused layer; expected one per shard")
        shard_id = shard_id or 0
        shard = layer.shards[shard_id]
        if loaded.shape[0] != -(-shard.full // self.bn):
            raise ValueError(f"has {loaded.shape[0]} block rows, expected for {shard.full} rows")
        rows = block_range(shard.rows, shard.full, self.bn, "rows")
        start = sum(len(r) for r in self.block_rows_per_shard()[:shard_id])
        dst = param.data.narrow(0, start, len(rows))
        copy_checked(dst, loaded[rows.start : rows.stop])
