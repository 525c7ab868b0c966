"""The cuda_ipc data path: one layer of a request, from the local pool into an opened remote pool.

Stream contract. The caller's current stream (the prefill compute stream) has queued the
layer's KV when `write_layer` is called, and may keep queuing later layers. Every copy runs on
a side stream that first waits for the compute stream (an event, not a host sync), so the call
returns at once and never delays compute. Per layer:
  same GPU:    gather `pool[layer][:, src]` (side) -> `remote[layer].index_copy_(1, dst, .)` (side)
  other GPU:   gather (side) -> peer-to-peer copy into a staging buffer on the remote GPU (side)
               -> `index_copy_` on a stream of the remote GPU that waits for that copy
An event recorded after the layer's last operation says when its bytes are in the remote pool;
events of one writer complete in issue order, so the latest one covers everything before it.

Allocator contract (tensors used on streams other than the one current at allocation): the
gathered tensor and the source indices are allocated on the side stream and used only there;
the remote staging buffer and destination indices are allocated on the remote stream, and the
side stream's copy into staging is always followed by the remote stream waiting for the side
stream, so memory the allocator recycles for the remote stream is never still being written.
No host synchronization happens here; index lists go up through pinned memory, asynchronously.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv_transfer.pool_io import upload_ids

# Up to this many aligned contiguous runs, a layer goes as plain copies of block ranges
# (2 per run: K and V), with no gather, staging or scatter: peer-to-peer at copy speed.
MAX_DIRECT_RUNS = 8


@dataclass(frozen=True)
class BlockIndex:
    src: torch.Tensor  # long, on the local pool's device
    dst: torch.Tensor  # long, on the remote pool's device
    runs: list[tuple[int, int, int]] | None  # (src start, dst start, length), or None: too many


def aligned_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """Maximal stretches where both the source and the destination blocks are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class DirectWriter:
    """Writes layers of `local` into `remote` (an IPC-opened pool, possibly on another GPU)."""

    def __init__(self, local: torch.Tensor, remote: torch.Tensor, side: torch.cuda.Stream) -> None:
        self.local = local
        self.remote = remote
        self.side = side  # on local.device, shared by every destination of one sender
        self.peer = remote.device != local.device
        self.remote_stream = torch.cuda.Stream(remote.device) if self.peer else side
        self._staging: torch.Tensor | None = None  # flat, on the remote GPU; grows, never shrinks

    @property
    def remote_num_blocks(self) -> int:
        return self.remote.shape[2]

    def index(self, src_ids: list[int], dst_ids: list[int]) -> BlockIndex:
        runs = aligned_runs(src_ids, dst_ids)
        return BlockIndex(
            upload_ids(src_ids, self.local.device, self.side),
            upload_ids(dst_ids, self.remote.device, self.remote_stream),
            runs if len(runs) <= MAX_DIRECT_RUNS else None,
        )

    def write_layer(self, layer: int, index: BlockIndex) -> torch.cuda.Event:
        """Queue the layer's copy; the event completes once its bytes are in the remote pool."""
        self.side.wait_stream(torch.cuda.current_stream(self.local.device))
        if index.runs is not None:
            # torch runs a cross-device copy on the source device's current stream (here the
            # side stream) and synchronizes both devices' current streams around it, so an
            # event on the side stream covers the bytes landing in the remote pool.
            with torch.cuda.stream(self.side):
                for src, dst, n in index.runs:
                    for kv in (0, 1):
                        self.remote[layer, kv, dst : dst + n].copy_(
                            self.local[layer, kv, src : src + n], non_blocking=True
                        )
                return _recorded(self.side)
        with torch.cuda.stream(self.side):
            gathered = self.local[layer].index_select(1, index.src)
            if not self.peer:
                self.remote[layer].index_copy_(1, index.dst, gathered)
                return _recorded(self.side)
        with torch.cuda.stream(self.remote_stream):
            staging = self._staging_like(gathered)
        self.side.wait_stream(self.remote_stream)  # the previous scatter has read the staging
        with torch.cuda.stream(self.side):
            staging.copy_(gathered, non_blocking=True)  # peer to peer, on the side stream
        self.remote_stream.wait_stream(self.side)
        with torch.cuda.stream(self.remote_stream):
            self.remote[layer].index_copy_(1, index.dst, staging)
            return _recorded(self.remote_stream)

    def _staging_like(self, gathered: torch.Tensor) -> torch.Tensor:
        """Allocated once, on the remote stream, sized for the largest request so far."""
        numel = gathered.numel()
        if self._staging is None or self._staging.numel() < numel:
            self._staging = torch.empty(numel, dtype=gathered.dtype, device=self.remote.device)
        return self._staging[:numel].view(gathered.shape)


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event
