"""The cuda_ipc data path: layers of a request, from the local pool into opened remote pools.

One kernel launch per remote pool per call (`common.model.kernels.block_copy`): programs on the
local GPU read each block's planes (K and V, or MLA's latent) and store them straight into the
remote pool, through the peer mapping when it lives on another GPU (NVLink or PCIe;
`kv_transfer.ipc_handles.open_pool` maps it for this GPU). No gather buffer, no staging on the remote GPU, no second pass there, no
host work per block.

Tensor parallel: the local pool holds the model's KV heads `heads`, each remote pool some heads
too (a decode node of several ranks exports one pool per rank). Each head the local pool holds
is written into every remote pool that holds it (`head_copies`), whole blocks where the two
pools hold the same heads, the heads' slice of each block otherwise.

Stream contract. The caller's current stream (the prefill compute stream) has queued the
layers' KV when `write_layers` is called, and may keep queuing later layers. The copy runs on a
side stream that first waits for the compute stream (an event, not a host sync), so the call
returns at once and never delays compute. The event it returns completes once the bytes are in
every remote pool; events of one writer complete in issue order, so the latest covers them all.

Allocator contract: the block pairs are uploaded (pinned, asynchronously) on the side stream and
used only there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv_transfer.ipc_handles import IpcUnavailable, OpenedPool
from kv_transfer.pool_io import raw


@dataclass(frozen=True)
class HeadCopy:
    """Heads of the local pool written into one remote pool (indices into each pool's own)."""

    target: int  # index into the remote pools
    src: range
    dst: range
    whole: bool  # both pools hold exactly these heads: whole blocks move


def head_copies(local: range, remotes: list[range]) -> list[HeadCopy]:
    """Where each of the model's KV heads `local` goes, given the heads each remote pool holds.
    IpcUnavailable when a local head has no remote pool (the receiver could never be DONE)."""
    copies, covered = [], set()
    for i, remote in enumerate(remotes):
        lo, hi = max(local.start, remote.start), min(local.stop, remote.stop)
        if lo >= hi:
            continue
        covered.update(range(lo, hi))
        src = range(lo - local.start, hi - local.start)
        dst = range(lo - remote.start, hi - remote.start)
        whole = (lo, hi) == (local.start, local.stop) == (remote.start, remote.stop)
        copies.append(HeadCopy(i, src, dst, whole))
    missing = sorted(set(local) - covered)
    if missing:
        raise IpcUnavailable(
            f"the receiver's pools hold KV heads {[list(r) for r in remotes]}, not {missing}"
        )
    return copies


class DirectWriter:
    """Writes layers of `local` (the model's KV heads `heads`) into IPC-opened pools (possibly
    on other GPUs), each holding the model's heads given with it."""

    def __init__(
        self,
        local: torch.Tensor,
        heads: range,
        remotes: list[tuple[OpenedPool, range]],
        side: torch.cuda.Stream,
    ) -> None:
        # Imported here, not at module level: kernels are decorated at import, and the CPU
        # tests decide about the Triton interpreter before that (common.model.kernels' docstring).
        from common.model.kernels import block_copy

        self._pairs = block_copy.block_pairs
        self.local = local
        self.side = side  # on local.device, shared by every destination of one sender
        copies = head_copies(heads, [remote_heads for _, remote_heads in remotes])
        self._copies = []
        holders: dict[str, None] = {}
        for copy in copies:
            remote = remotes[copy.target][0]
            # An IPC-opened pool is mapped for this GPU already; a pool of this process on
            # another GPU (sender and receiver in one process) needs peer access.
            block_copy.enable_peer_access(local.device, remote.tensor.device)
            # Bytes are bytes: a float8 pool is copied as uint8 (GPUs without float8 loads too).
            src, dst = raw(local), raw(remote.tensor)
            if copy.whole:
                self._copies.append(block_copy.BlockCopier(src, dst))
            else:
                self._copies.append(block_copy.HeadCopier(src, dst, copy.src, copy.dst))
            holders[str(remote.holder)] = None
        self.holder = ", ".join(holders)  # the GPUs that hold the remote pools written
        self.remote_num_blocks = min(remotes[c.target][0].tensor.shape[2] for c in copies)

    def block_pairs(self, src_ids: list[int], dst_ids: list[int]) -> torch.Tensor:
        """The request's (source, destination) block pairs, on the local GPU (side stream); the
        same for every remote pool (a TP node's ranks share block ids)."""
        host = self._pairs(src_ids, dst_ids).pin_memory()
        with torch.cuda.stream(self.side):
            return host.to(self.local.device, non_blocking=True)

    def write_layers(self, layers: range, pairs: torch.Tensor) -> torch.cuda.Event:
        """Queue the copy of `layers`; the event completes once their bytes are remote."""
        self.side.wait_stream(torch.cuda.current_stream(self.local.device))
        with torch.cuda.stream(self.side):
            for copy in self._copies:
                copy(pairs, layers)
            event = torch.cuda.Event()
            event.record(self.side)
        return event
