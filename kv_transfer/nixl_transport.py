"""NIXL transport: the prefill node WRITEs KV straight into the decode node's pool through NIXL
agents (UCX underneath: RDMA between hosts where there is a NIC for it, TCP where there is not).

The wire and its guarantees are cuda_ipc's (kv_transfer.cuda_ipc's docstring): one ZMQ socket
at the receiver's KV address for the handshake and small signed notices ("start", "complete",
"abort", "cancel"), the same cancel protocol (a cancelled transfer's blocks stay held until the
sender confirms that its writes are over), and the same fallback to [layer header, payload]
frames when the direct path cannot work (no nixl on the peer, layouts differ). Only the export
and the data path differ:

  decode  registers its whole pool with its agent once and answers "hello" with a
          `NixlExport`: the agent's metadata, the pool's address, device and shape.
  prefill loads that metadata (`add_remote_agent`), registers its own pool, and per call of
          send_layer(s) posts one WRITE whose descriptors pair its blocks with the reserved
          ones (kv_transfer.nixl_layout). On a GPU the WRITE is posted only once the compute
          stream has produced the layer (an event per call, polled). "complete" goes out once
          every WRITE of the request reports DONE, so the decode node never admits a request
          whose blocks are half written; an ERR fails the request instead.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from kv_transfer.base import TransferConfig
from kv_transfer.cuda_ipc import CudaIpcReceiver
from kv_transfer.ipc_handles import (
    NoExport,
    PoolExport,
    host_id,
    register_kind,
)
from kv_transfer.ipc_sender import CudaIpcSender
from kv_transfer.nixl_layout import PoolRegion, Run, block_runs, layer_descriptors

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'pdserve[nixl]'"
SETTLE_TIMEOUT_S = 30.0  # a failing request waits this long at most for its posted WRITEs


class NixlUnavailable(RuntimeError):
    pass


def missing_reason() -> str | None:
    """Why `--transport nixl` cannot start here (the package is absent), None if it can."""
    if importlib.util.find_spec("nixl") is None:
        return f"--transport nixl needs the nixl package, which is not installed ({INSTALL_HINT})"
    return None


@dataclass(frozen=True)
class NixlExport:
    session: str  # as PoolExport's: "start" messages name it
    host_id: str
    agent_metadata: bytes  # nixl_agent.get_agent_metadata() of the receiver
    base: int  # address of the pool's first element
    device_id: int
    mem_type: str  # "DRAM" or "VRAM"
    dtype: str
    shape: list[int]  # [num_layers, planes, num_blocks, block_size, heads, head_dim]


register_kind("nixl_export", NixlExport)


def _region(pool: torch.Tensor) -> tuple[PoolRegion, str]:
    if not pool.is_contiguous():
        raise NixlUnavailable("the KV pool is not contiguous")
    block_bytes = pool[0, 0, 0].numel() * pool.element_size()
    device_id = (pool.device.index or 0) if pool.device.type == "cuda" else 0
    region = PoolRegion(
        pool.data_ptr(), device_id, pool.shape[0], pool.shape[2], block_bytes, pool.shape[1]
    )
    return region, "VRAM" if pool.device.type == "cuda" else "DRAM"


class _Agent:
    """A NIXL agent with one pool registered; every nixl call of this module goes through it."""

    def __init__(self, role: str, pool: torch.Tensor) -> None:
        reason = missing_reason()
        if reason is not None:
            raise NixlUnavailable(reason)
        try:
            from nixl._api import nixl_agent, nixl_agent_config

            self.name = f"pdserve-{role}-{os.getpid()}-{secrets.token_hex(4)}"
            self.agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"]))
            self.region, self.mem_type = _region(pool)
            self.registered = self.agent.register_memory(pool)
        except NixlUnavailable:
            raise
        except Exception as exc:  # nixl raises its own binding types
            raise NixlUnavailable(f"cannot create a NIXL agent: {exc}") from exc
        self.pool = pool  # registered memory must outlive the agent's use of it

    def close(self) -> None:
        try:
            self.agent.deregister_memory(self.registered)
        except Exception as exc:
            log.debug("nixl deregister failed: %s", exc)


class NixlReceiver(CudaIpcReceiver):
    """cuda_ipc's receiver whose handshake answer is the NIXL export of its pool."""

    _agent: _Agent | None = None

    def _export_pool(self, pool: torch.Tensor) -> NixlExport | NoExport:
        try:
            self._agent = _Agent("decode", pool)
        except NixlUnavailable as exc:
            log.warning("nixl: KV will arrive as frames: %s", exc)
            return NoExport(self._session, host_id(), str(exc))
        return NixlExport(
            self._session,
            host_id(),
            self._agent.agent.get_agent_metadata(),
            self._agent.region.base,
            self._agent.region.device_id,
            self._agent.mem_type,
            str(pool.dtype),
            list(pool.shape),
        )

    def close(self) -> None:
        if self._agent is not None:
            self._agent.close()
            self._agent = None
        super().close()


class NixlWrites:
    """One request's WRITEs: queued per send_layer(s) call, posted once their layers are final.

    Stands where cuda_ipc keeps the request's last copy event: `query()` is True once every
    WRITE is DONE; `synchronize()` drops what is not posted yet and waits out the rest."""

    def __init__(self, writer: NixlWriter, runs: list[Run]) -> None:
        self.writer = writer
        self.runs = runs
        self.pending: deque[tuple[range, torch.cuda.Event | None]] = deque()
        self.posted: list[Any] = []  # nixl transfer handles
        self.error: str | None = None

    def pump(self) -> None:
        while self.pending and self.error is None:
            layers, ready = self.pending[0]
            if ready is not None and not ready.query():
                return
            self.pending.popleft()
            try:
                self.posted.append(self.writer.post(layers, self.runs))
            except Exception as exc:  # the binding's own error types
                self.error = f"nixl WRITE of layers {layers} failed to post: {exc}"

    def _states(self) -> list[str]:
        states = [self.writer.state(handle) for handle in self.posted]
        if "ERR" in states and self.error is None:
            self.error = "a nixl WRITE ended in ERR"
        return states

    def query(self) -> bool:
        self.pump()
        done = not self.pending and all(s == "DONE" for s in self._states())
        if done and self.error is None:
            self._release()
            return True
        return False

    def synchronize(self) -> None:
        self.pending.clear()  # never posted: nothing reads or writes their blocks
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while "PROC" in self._states() and time.monotonic() < deadline:
            time.sleep(0.001)
        self._release()

    def _release(self) -> None:
        for handle in self.posted:
            self.writer.release(handle)
        self.posted.clear()


class NixlWriter:
    """The data path to one receiver: WRITEs from the local pool into its registered pool."""

    def __init__(self, agent: _Agent, export: NixlExport) -> None:
        local = agent.pool
        if export.dtype != str(local.dtype) or export.shape[:2] + export.shape[3:] != (
            list(local.shape[:2]) + list(local.shape[3:])
        ):
            raise NixlUnavailable(
                f"pool layouts differ: local {str(local.dtype)} {list(local.shape)}, "
                f"remote {export.dtype} {export.shape}"
            )
        self.agent = agent
        self.remote = PoolRegion(
            export.base, export.device_id, export.shape[0], export.shape[2],
            agent.region.block_bytes, export.shape[1],
        )  # fmt: skip
        self.remote_mem_type = export.mem_type
        try:
            self.remote_name = agent.agent.add_remote_agent(export.agent_metadata)
        except Exception as exc:
            raise NixlUnavailable(f"cannot load the receiver's NIXL metadata: {exc}") from exc
        name = self.remote_name
        self.holder = f"nixl:{name.decode() if isinstance(name, bytes) else name}"

    @property
    def remote_num_blocks(self) -> int:
        return self.remote.num_blocks

    def block_pairs(self, src_ids: list[int], dst_ids: list[int]) -> NixlWrites:
        return NixlWrites(self, block_runs(src_ids, dst_ids))

    def write_layers(self, layers: range, job: NixlWrites) -> NixlWrites:
        ready = None
        if self.agent.pool.device.type == "cuda":  # the layers are queued, maybe not computed
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.agent.pool.device))
        job.pending.append((layers, ready))
        job.pump()
        return job

    def post(self, layers: range, runs: list[Run]) -> Any:
        local, remote = layer_descriptors(self.agent.region, self.remote, layers, runs)
        nixl = self.agent.agent
        handle = nixl.initialize_xfer(
            "WRITE",
            nixl.get_xfer_descs(local, self.agent.mem_type),
            nixl.get_xfer_descs(remote, self.remote_mem_type),
            self.remote_name,
        )
        if nixl.transfer(handle) == "ERR":
            raise NixlUnavailable("transfer() returned ERR")
        return handle

    def state(self, handle: Any) -> str:
        return self.agent.agent.check_xfer_state(handle)

    def release(self, handle: Any) -> None:
        try:
            self.agent.agent.release_xfer_handle(handle)
        except Exception as exc:
            log.debug("nixl release failed: %s", exc)


class NixlSender(CudaIpcSender):
    """cuda_ipc's sender whose direct path is a `NixlWriter` (frames when it cannot be)."""

    def __init__(self, pool: torch.Tensor, config: TransferConfig) -> None:
        super().__init__(pool, config)
        self._agent: _Agent | None = None  # made on the first handshake

    def _progress(self) -> None:
        """Post the WRITEs whose layers became final; fail requests with a WRITE in ERR (before
        cuda_ipc's progress could send their "complete")."""
        for request_id, job in list(self._jobs.items()):
            writes = job.last_write
            if isinstance(writes, NixlWrites):
                writes.pump()
                entry = self._ledger.table.get(request_id)
                if writes.error is None:
                    writes._states()
                if writes.error is not None and entry is not None:
                    self._fail(entry, writes.error)
        super()._progress()

    def close(self) -> None:
        super().close()
        if self._agent is not None:
            self._agent.close()
            self._agent = None

    EXPORTS = (NixlExport, NoExport, PoolExport)  # a cuda_ipc receiver answers a PoolExport
    TRANSPORT, DIRECT_PATH = "nixl", "NIXL WRITEs"

    def _open(self, reply: Any) -> tuple[NixlWriter | None, str]:
        if not isinstance(reply, NixlExport):
            return None, getattr(reply, "reason", "the receiver does not speak nixl")
        try:
            return NixlWriter(self._local_agent(), reply), ""
        except NixlUnavailable as exc:
            return None, str(exc)

    def _local_agent(self) -> _Agent:
        if self._agent is None:
            self._agent = _Agent("prefill", self._pool)
        return self._agent
