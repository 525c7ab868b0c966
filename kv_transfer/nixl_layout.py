"""Where a request's KV lives in a pool, as NIXL descriptors: (address, length, device id) rows.

Pure Python and numpy (no torch, no nixl), so the address arithmetic is tested on its own.

A pool is one contiguous tensor `[num_layers, planes, num_blocks, block_size, heads, head_dim]`
(planes 2: K and V; 1: MLA's latent), so one plane of one block of one layer is `block_bytes`
contiguous bytes at `base + ((layer * planes + plane) * num_blocks + block) * block_bytes`. The
sender's and the receiver's pools have the same shape except `num_blocks`. A request's blocks
are written pairwise (source block i into destination block i); where both lists run on
consecutively, the pairs merge into one descriptor, so a prompt whose blocks were allocated in
order is one descriptor per plane and layer. Row i of the local list always pairs with row i of
the remote list: the order is by layer, then plane (K before V), then by run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PoolRegion:
    """One pool's memory as NIXL sees it (the remote one arrives in the receiver's export)."""

    base: int  # address of element 0
    device_id: int  # GPU index in its own process; 0 for host memory
    num_layers: int
    num_blocks: int
    block_bytes: int  # one plane's block: block_size * heads * head_dim * element size
    planes: int = 2  # K and V; 1: MLA's latent

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_blocks, self.block_bytes) < 1 or self.base < 0:
            raise ValueError(f"not a pool region: {self}")
        if self.planes not in (1, 2):
            raise ValueError(f"a pool region has 1 or 2 planes, got {self.planes}")

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.planes * self.num_blocks * self.block_bytes

    def offset(self, layer: int, plane: int, block: int) -> int:
        return ((layer * self.planes + plane) * self.num_blocks + block) * self.block_bytes


@dataclass(frozen=True)
class Run:
    src: int  # first source block
    dst: int  # first destination block
    length: int  # blocks


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[Run]:
    """Pairs (src_ids[i], dst_ids[i]) merged into runs where both sides are consecutive."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks, {len(dst_ids)} destination blocks")
    runs: list[Run] = []
    for src, dst in zip(src_ids, dst_ids, strict=True):
        last = runs[-1] if runs else None
        if last is not None and src == last.src + last.length and dst == last.dst + last.length:
            runs[-1] = Run(last.src, last.dst, last.length + 1)
        else:
            runs.append(Run(src, dst, 1))
    return runs


def layer_descriptors(
    local: PoolRegion, remote: PoolRegion, layers: range, runs: list[Run]
) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 uint64 arrays (local rows, remote rows) for every plane of `runs` in `layers`.

    ValueError when a block or layer lies outside either pool, or the layouts differ."""
    mine = (local.num_layers, local.planes, local.block_bytes)
    theirs = (remote.num_layers, remote.planes, remote.block_bytes)
    if mine != theirs:
        raise ValueError(
            f"pool layouts differ: local {local.num_layers} layers x {local.planes} planes x "
            f"{local.block_bytes} B blocks, remote {remote.num_layers} x {remote.planes} x "
            f"{remote.block_bytes} B"
        )
    if layers.step != 1 or not 0 <= layers.start <= layers.stop <= local.num_layers:
        raise ValueError(f"layers {layers} outside [0, {local.num_layers})")
    for run in runs:
        if run.src + run.length > local.num_blocks or run.dst + run.length > remote.num_blocks:
            raise ValueError(
                f"blocks {run} outside the pools ({local.num_blocks} local, "
                f"{remote.num_blocks} remote)"
            )
    planes = range(local.planes)
    rows = [(layer, plane, run) for layer in layers for plane in planes for run in runs]
    out_local = np.empty((len(rows), 3), dtype=np.uint64)
    out_remote = np.empty((len(rows), 3), dtype=np.uint64)
    for i, (layer, plane, run) in enumerate(rows):
        size = run.length * local.block_bytes
        out_local[i] = (local.base + local.offset(layer, plane, run.src), size, local.device_id)
        out_remote[i] = (
            remote.base + remote.offset(layer, plane, run.dst), size, remote.device_id
        )  # fmt: skip
    return out_local, out_remote
