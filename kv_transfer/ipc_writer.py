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


@dataclass(frozen=True)
class BlockIndex:
    src: torch.Tensor  # long, on the local pool's device
    dst: torch.Tensor  # long, on the remote pool's device


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
        return BlockIndex(
            upload_ids(src_ids, self.local.device, self.side),
            upload_ids(dst_ids, self.remote.device, self.remote_stream),
        )

    def write_layer(self, layer: int, index: BlockIndex) -> torch.cuda.Event:
        """Queue the layer's copy; the event completes once its bytes are in the remote pool."""
        self.side.wait_stream(torch.cuda.current_stream(self.local.device))
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
