"""The cuda_ipc data path: layers of a request, from the local pool into an opened remote pool.

One kernel launch per call (`common.model.kernels.block_copy`): programs on the local GPU read each
block's planes (K and V, or MLA's latent) and store them straight into the remote pool, through the peer mapping when it
lives on another GPU (NVLink or PCIe; `kv_transfer.ipc_handles.open_pool` maps it for this GPU).
No gather buffer, no staging on the remote GPU, no second pass there, no host work per block.

Stream contract. The caller's current stream (the prefill compute stream) has queued the
layers' KV when `write_layers` is called, and may keep queuing later layers. The copy runs on a
side stream that first waits for the compute stream (an event, not a host sync), so the call
returns at once and never delays compute. The event it returns completes once the bytes are in
the remote pool; events of one writer complete in issue order, so the latest covers them all.

Allocator contract: the block pairs are uploaded (pinned, asynchronously) on the side stream and
used only there.
"""

from __future__ import annotations

import torch

from kv_transfer.ipc_handles import OpenedPool
from kv_transfer.pool_io import raw


class DirectWriter:
    """Writes layers of `local` into `remote` (an IPC-opened pool, possibly on another GPU)."""

    def __init__(self, local: torch.Tensor, remote: OpenedPool, side: torch.cuda.Stream) -> None:
        # Imported here, not at module level: kernels are decorated at import, and the CPU
        # tests decide about the Triton interpreter before that (common.model.kernels' docstring).
        from common.model.kernels import block_copy

        self._pairs = block_copy.block_pairs
        self.local = local
        self.remote = remote.tensor
        self.holder = remote.holder  # the GPU that holds the remote pool
        self.side = side  # on local.device, shared by every destination of one sender
        # An IPC-opened pool is mapped for this GPU already; a pool of this process on another
        # GPU (sender and receiver in one process) needs peer access.
        block_copy.enable_peer_access(local.device, self.remote.device)
        # Bytes are bytes: a float8 pool is copied as uint8 (GPUs without float8 loads too).
        self._copy = block_copy.BlockCopier(raw(local), raw(self.remote))

    @property
    def remote_num_blocks(self) -> int:
        return self.remote.shape[2]

    def block_pairs(self, src_ids: list[int], dst_ids: list[int]) -> torch.Tensor:
        """The request's (source, destination) block pairs, on the local GPU (side stream)."""
        host = self._pairs(src_ids, dst_ids).pin_memory()
        with torch.cuda.stream(self.side):
            return host.to(self.local.device, non_blocking=True)

    def write_layers(self, layers: range, pairs: torch.Tensor) -> torch.cuda.Event:
        """Queue the copy of `layers`; the event completes once their bytes are remote."""
        self.side.wait_stream(torch.cuda.current_stream(self.local.device))
        with torch.cuda.stream(self.side):
            self._copy(pairs, layers)
            event = torch.cuda.Event()
            event.record(self.side)
        return event
