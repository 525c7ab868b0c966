"""CUDA IPC plumbing of the cuda_ipc transport: the handshake messages, and exporting and
opening a decode node's KV pool.

The decode node exports its pool once: `pool.untyped_storage()._share_cuda_()` gives the CUDA
IPC handle of the allocation holding it (plus torch's IPC ref-counter and event handles); with
dtype, shape, stride and storage offset, a sender rebuilds a tensor over the same memory with
`torch.UntypedStorage._new_shared_cuda`, opened in the sender GPU's context so that its
kernels can store into it (open_pool). Device indices differ between processes
(CUDA_VISIBLE_DEVICES), so the export names the GPU by UUID; it names the host (hostname + boot
id) too, since a handle means nothing on another machine or after a reboot.

A tensor-parallel decode node answers with every rank's export (`RankExports`, each pool with
the model's KV heads it holds); a sender opens those holding its heads.

Messages (msgpack `{"kind": ..., **fields}`, checked like kv_transfer.frames' headers):
  sender -> receiver  "hello"                 first contact (the sender's first begin())
  receiver -> sender  "export" | "rank_exports" | "no_export"
                                              the pool handle(s), or why there is none
  sender -> receiver  "start"                 a transfer begins, in which KV format; before any
                                              of its bytes
  receiver -> sender  "cancel"                stop writing that request, answer with "abort"
  receiver -> sender  "reset"                 your export is stale (this receiver restarted)
plus the "layer", "complete" and "abort" headers of kv_transfer.frames.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import weakref
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import msgpack
import torch

from common.protocol.messages import MessageError, from_fields
from common.protocol.wire_auth import SIGNER
from kv_transfer.frames import KINDS, decode_header


@dataclass(frozen=True)
class Hello:
    host_id: str
    pid: int


@dataclass(frozen=True)
class PoolExport:
    session: str  # random per receiver: a "start" naming another session used a stale export
    host_id: str
    pid: int
    device_uuid: str
    dtype: str  # str(torch dtype)
    shape: list[int]  # [num_layers, planes, num_blocks, block_size, heads, head_dim]
    stride: list[int]
    storage_offset: int  # elements
    # The fields of `torch.UntypedStorage._share_cuda_()`, in its order (the device index is
    # the receiver's own; the sender substitutes the index of the same GPU in its process).
    storage_device: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True)
class NoExport:
    session: str
    host_id: str
    reason: str


@dataclass(frozen=True)
class RankExports:
    """A tensor-parallel decode node's answer to "hello": every rank's pool, in rank order."""

    session: str  # rank 0's receiver's (what a direct "start" names)
    host_id: str
    pools: list[Any]  # PoolExport field maps (decoded into PoolExports)
    heads: list[list[int]]  # [start, stop) of the model's KV heads each pool holds

    def __post_init__(self) -> None:
        if len(self.pools) != len(self.heads) or not self.pools:
            raise ValueError(f"{len(self.pools)} pools for {len(self.heads)} head ranges")
        if any(len(h) != 2 or not 0 <= h[0] < h[1] for h in self.heads):
            raise ValueError(f"bad head ranges {self.heads}")
        pools = [p if isinstance(p, PoolExport) else _pool_export(p) for p in self.pools]
        object.__setattr__(self, "pools", pools)

    def targets(self) -> list[tuple[PoolExport, range]]:
        return [(p, range(*h)) for p, h in zip(self.pools, self.heads, strict=True)]


def _pool_export(fields: Any) -> PoolExport:
    if not isinstance(fields, dict):
        raise ValueError(f"a rank's pool export is a {type(fields).__name__}, not a map")
    try:
        return from_fields(PoolExport, dict(fields))
    except MessageError as exc:
        raise ValueError(str(exc)) from None


@dataclass(frozen=True)
class Start:
    request_id: str
    session: str  # of the export the sender writes through ("" when it sends frames)
    direct: bool  # True: the sender writes the pool itself; False: layers come as frames
    kv_format: dict[str, Any] | None = None  # the sender's KVFormat (the receiver checks it)
    # Direct: [start, stop) of the model's KV heads it writes (None: all); frames carry theirs.
    heads: list[int] | None = None
    senders: int = 1  # prefill ranks that each write a share of the heads (tensor parallel)
    # Direct: [start, stop) of the model's layers it writes (None: all; a pipeline stage's).
    layers: list[int] | None = None


@dataclass(frozen=True)
class Cancel:
    request_id: str
    reason: str = ""  # why the receiver gave up on it (the sender's error says so)


@dataclass(frozen=True)
class Reset:
    reason: str


IPC_KINDS: dict[str, type] = {
    "hello": Hello,
    "export": PoolExport,
    "no_export": NoExport,
    "rank_exports": RankExports,
    "start": Start,
    "cancel": Cancel,
    "reset": Reset,
}
ALL_KINDS: dict[str, type] = {**KINDS, **IPC_KINDS}
_KIND_OF: dict[type, str] = {cls: kind for kind, cls in IPC_KINDS.items()}


def register_kind(kind: str, cls: type) -> None:
    """A transport that shares this wire adds a message of its own (nixl: its pool export)."""
    if ALL_KINDS.get(kind, cls) is not cls:
        raise ValueError(f"message kind {kind!r} is taken by {ALL_KINDS[kind].__name__}")
    IPC_KINDS[kind] = ALL_KINDS[kind] = cls
    _KIND_OF[cls] = kind


def encode_message(message: Any) -> bytes:
    """One of this module's messages (frames' headers have `encode_header`)."""
    fields = dataclasses.asdict(message)
    return SIGNER.sign(
        msgpack.packb({"kind": _KIND_OF[type(message)], **fields}, use_bin_type=True)
    )


def decode_message(frame: bytes) -> Any:
    """Any message of the cuda_ipc wire (frames' headers included); raises FrameError only."""
    return decode_header(frame, ALL_KINDS)


# -- who and where ----------------------------------------------------------------------------


@cache
def host_id() -> str:
    """Hostname plus kernel boot id: equal only for processes that can share CUDA IPC handles."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    boot_id = boot.read_text().strip() if boot.exists() else "no-boot-id"
    return f"{socket.gethostname()}/{boot_id}"


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_device_index(uuid: str) -> int | None:
    """The index this process gives the GPU with `uuid`, None if it does not see that GPU."""
    return next((i for i in range(torch.cuda.device_count()) if device_uuid(i) == uuid), None)


# -- export and open ----------------------------------------------------------------------------


class IpcUnavailable(Exception):
    """CUDA IPC cannot be used between these two pools; the message says why."""


# Pools exported by receivers of this process, by session: CUDA refuses to open an IPC handle in
# the process that exported it, so a sender in the same process (tests, single-process setups)
# uses the tensor itself. Weak, so a forgotten receiver does not keep its pool alive.
_IN_PROCESS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


def export_pool(pool: torch.Tensor, session: str) -> PoolExport:
    """Export the pool's allocation once (raises IpcUnavailable). Until `forget_export`, a sender
    in this process finds the pool by session."""
    if pool.device.type != "cuda":
        raise IpcUnavailable(f"the receiver's pool is on {pool.device.type}, not a GPU")
    try:
        fields = pool.untyped_storage()._share_cuda_()
    except RuntimeError as exc:  # e.g. an allocator configuration that cannot share
        raise IpcUnavailable(f"the receiver cannot export its pool: {exc}") from None
    device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = fields
    _IN_PROCESS[session] = pool
    return PoolExport(
        session=session,
        host_id=host_id(),
        pid=os.getpid(),
        device_uuid=device_uuid(pool.device.index),
        dtype=str(pool.dtype),
        shape=list(pool.shape),
        stride=list(pool.stride()),
        storage_offset=pool.storage_offset(),
        storage_device=device,
        storage_handle=handle,
        storage_size_bytes=size,
        storage_offset_bytes=offset,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event_handle,
        event_sync_required=bool(event_sync),
    )


def export_or_refusal(pool: torch.Tensor, session: str) -> PoolExport | NoExport:
    """A receiver's answer to "hello" for `pool`: its export, or why a sender cannot write it."""
    try:
        return export_pool(pool, session)
    except IpcUnavailable as exc:
        return NoExport(session, host_id(), str(exc))


def forget_export(session: str) -> None:
    _IN_PROCESS.pop(session, None)


@dataclass(frozen=True)
class OpenedPool:
    """A receiver's pool as this process reaches it."""

    tensor: torch.Tensor  # on the local pool's device (see open_pool), or the receiver's own
    holder: torch.device  # the GPU whose memory holds the pool, as this process names it


def open_pool(export: PoolExport, local_pool: torch.Tensor) -> OpenedPool:
    """Open the receiver's pool for kernels of the local pool's GPU. Raises IpcUnavailable with
    the reason when the sender must send frames.

    The IPC handle is opened in the local GPU's context (cudaIpcOpenMemHandle with lazy peer
    access), as peer-writing kernels need: memory opened in the holder GPU's context is not
    mapped for kernels of another GPU, whatever peer access says. torch therefore labels the
    tensor with the local device although its bytes live on `holder`; only the copy kernel
    (common.model.kernels.block_copy) touches it, through NVLink or PCIe."""
    if export.host_id != host_id():
        raise IpcUnavailable(f"the receiver runs on another host ({export.host_id})")
    if local_pool.device.type != "cuda":
        raise IpcUnavailable(f"the local pool is on {local_pool.device.type}, not a GPU")
    # Head counts may differ: a tensor-parallel pool holds a share (the caller maps heads);
    # planes may not (a latent pool is not half a K/V one).
    local_layout = [str(local_pool.dtype), *_per_head(list(local_pool.shape))]
    remote_layout = [export.dtype, *_per_head(export.shape)]
    if len(export.shape) != local_pool.dim() or remote_layout != local_layout:
        raise IpcUnavailable(
            f"pool layouts differ: receiver {export.dtype} {export.shape}, "
            f"sender {local_pool.dtype} {list(local_pool.shape)}"
        )
    index = local_device_index(export.device_uuid)
    if index is None:
        raise IpcUnavailable(f"the receiver's GPU {export.device_uuid} is not visible here")
    here = local_pool.device.index
    if index != here and not torch.cuda.can_device_access_peer(here, index):
        raise IpcUnavailable(f"cuda:{here} has no peer access to the receiver's cuda:{index}")
    holder = torch.device("cuda", index)
    if export.pid == os.getpid():
        pool = _IN_PROCESS.get(export.session)
        if pool is None:
            raise IpcUnavailable("the receiver of this process that exported the pool is gone")
        return OpenedPool(pool, holder)  # allocated by this process: peer access maps it
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            here,  # the context that opens the handle: the local GPU's (docstring)
            export.storage_handle,
            export.storage_size_bytes,
            export.storage_offset_bytes,
            export.ref_counter_handle,
            export.ref_counter_offset,
            export.event_handle,
            export.event_sync_required,
        )
    except Exception as exc:  # torch surfaces CUDA IPC errors as RuntimeError, others as TypeError
        raise IpcUnavailable(f"cannot open the receiver's IPC handle: {exc}") from None
    return OpenedPool(_view(storage, export, local_pool, here), holder)


def _per_head(shape: list[int]) -> list[int]:
    """What two pools must share for KV heads to be copied between them: layers, K and V,
    block size, head dim."""
    return [shape[0], shape[1], *shape[3:4], *shape[5:]]


def _view(
    storage: torch.UntypedStorage, export: PoolExport, local_pool: torch.Tensor, index: int
) -> torch.Tensor:
    """`set_` does not bound-check an untyped storage; do it, since a bad export would let the
    sender write outside the receiver's pool."""
    shape, stride = export.shape, export.stride
    if len(stride) != len(shape) or min(shape) <= 0 or min(stride) < 0 or export.storage_offset < 0:
        raise IpcUnavailable(f"bad pool geometry: shape {shape}, stride {stride}")
    last = export.storage_offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    if (last + 1) * local_pool.element_size() > storage.nbytes():
        raise IpcUnavailable(f"the exported pool does not fit its {storage.nbytes()}-byte storage")
    tensor = torch.empty(0, dtype=local_pool.dtype, device=torch.device("cuda", index))
    return tensor.set_(storage, export.storage_offset, shape, stride)
