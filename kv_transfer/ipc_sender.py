"""The prefill side of the cuda_ipc transport (protocol: kv_transfer.cuda_ipc's docstring).

Per receiver address, one DEALER socket and one handshake, whose outcome (`Route`) is kept for
the sender's lifetime (until the receiver sends "reset"): direct CUDA IPC writes through a
`DirectWriter`, or zmq-style frames staged through pinned host memory (`HostStager`). A
tensor-parallel prefill rank's sender writes the KV heads its pool holds (`TransferConfig`'s
head_start) into every pool of the receiver's node that holds them, and its notices say how
many ranks send (`senders`).

Non-blocking contract: begin() blocks only for a first handshake (up to HANDSHAKE_TIMEOUT_S;
connect() does it ahead of time); in direct mode send_layer() queues GPU work and returns without
a host sync (frames mode stages like zmq_transport); complete() queues the notice, which poll()
(or a later call) sends once the request's last write event completed. abort() and failures
wait for the request's queued copies, so its source blocks are free to reuse when the caller
learns of it. Incoming "cancel" / "reset" notices are read at the start of every call.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from kv_transfer.base import KVSender, Transfer, TransferConfig, TransferState
from kv_transfer.frames import AbortHeader, FrameError, encode_header
from kv_transfer.frames_receiver import MAX_MESSAGES_PER_POLL
from kv_transfer.frames_sender import FrameSender, completion_frames, connect
from kv_transfer.ipc_handles import (
    Cancel,
    Hello,
    IpcUnavailable,
    NoExport,
    OpenedPool,
    PoolExport,
    RankExports,
    Reset,
    Start,
    decode_message,
    encode_message,
    host_id,
    open_pool,
)
from kv_transfer.ipc_writer import DirectWriter
from kv_transfer.ledger import DEADLINE_EXCEEDED, INJECTED_FAILURE, Outgoing
from kv_transfer.pool_io import sender_ledger

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
FLUSH_POLL_S = 1e-4
CANCELLED_BY_RECEIVER = "cancelled by the receiver"
REMEMBERED_CANCELS = 10_000  # cancels of requests not begun yet, kept so begin() can refuse them


@dataclass(frozen=True)
class Route:
    """How this sender reaches one receiver."""

    direct: bool  # True: CUDA IPC writes into its pool; False: frames through host memory
    reason: str  # why not direct ("" when direct)
    device: str  # the receiver's GPU as this process names it ("" when not direct)


@dataclass
class _Destination:
    address: str
    socket: zmq.Socket
    route: Route | None = None  # None until a handshake (again after a "reset")
    writer: DirectWriter | None = None
    session: str = ""


@dataclass
class _DirectJob:
    address: str
    writer: DirectWriter
    pairs: torch.Tensor  # (source, destination) block pairs, on the local GPU
    last_write: torch.cuda.Event | None = None  # completes after every earlier write of the job
    completion: list[Any] | None = None  # "complete" (+ payload), sent once last_write completed


class CudaIpcSender(KVSender):
    def __init__(self, pool: torch.Tensor, config: TransferConfig) -> None:
        self._pool = pool
        self._ledger = sender_ledger(config, pool)
        self._linger_ms = round(config.close_linger_s * 1000)
        self._side = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None
        self._ctx = zmq.Context()
        self._destinations: dict[str, _Destination] = {}
        self._jobs: dict[str, _DirectJob] = {}
        self._frames = FrameSender(pool, self._ledger, config, self._socket)
        self._cancelled: OrderedDict[tuple[str, str], str] = OrderedDict()  # (address, id) -> why
        self._format = None if config.kv_format is None else config.kv_format.to_dict()
        # The model's KV heads this pool holds, and the ranks of its node that each send theirs.
        self._heads = range(config.head_start, config.head_start + pool.shape[4])
        # A pipeline stage's pool holds the model's layers from layer_start on.
        self._layers = range(config.layer_start, config.layer_start + pool.shape[0])
        self._senders = config.senders
        self._closed = False

    def connect(self, dest_address: str) -> Route | None:
        """Handshake now rather than in the first begin(); None if the address is unusable."""
        dest = self._destination(dest_address)
        return None if dest is None else dest.route

    def route(self, dest_address: str) -> Route | None:
        """The path to a receiver already contacted, None before the first contact."""
        dest = self._destinations.get(dest_address)
        return None if dest is None else dest.route

    def writer(self, dest_address: str) -> DirectWriter | None:
        """The direct data path to a receiver already contacted (None: frames, or no contact);
        for benchmarks that time the copies alone."""
        dest = self._destinations.get(dest_address)
        return None if dest is None else dest.writer

    def begin(
        self,
        request_id: str,
        dest_address: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
    ) -> Transfer:
        self._notices()
        entry = self._ledger.begin(request_id, dest_address, src_block_ids, dst_block_ids)
        dest = self._destination(dest_address)
        if dest is None:
            self._ledger.table.finish(
                request_id, TransferState.FAILED, f"cannot connect to {dest_address!r}"
            )
            return entry.transfer
        if (dest_address, request_id) in self._cancelled:
            reason = self._cancelled.pop((dest_address, request_id))
            self._fail(entry, _cancelled(reason))
            return entry.transfer
        writer = dest.writer
        if writer is not None:
            outside = [b for b in dst_block_ids if b >= writer.remote_num_blocks]
            if outside:
                self._fail(entry, f"destination blocks {outside[:8]} outside the receiver's pool")
                return entry.transfer
            pairs = writer.block_pairs(entry.transfer.block_ids, entry.dst_block_ids)
            self._jobs[request_id] = _DirectJob(dest_address, writer, pairs)
        direct = writer is not None
        heads = [self._heads.start, self._heads.stop] if direct else None
        layers = [self._layers.start, self._layers.stop] if direct else None
        session = dest.session if direct else ""
        start = Start(request_id, session, direct, self._format, heads, self._senders, layers)
        if not self._send(dest_address, [encode_message(start)]):
            self._fail(entry, f"send queue to {dest_address} is full")
        return entry.transfer

    def send_layer(self, request_id: str, layer: int) -> None:
        self.send_layers(request_id, range(layer, layer + 1))

    def send_layers(self, request_id: str, layers: range) -> None:
        """Direct mode: one copy kernel for every layer of `layers` (a step-1 range)."""
        self._notices()
        entry = self._ledger.lookup(request_id)
        if entry is None:
            return
        if layers.step != 1:
            raise ValueError(f"{layers} is not a step-1 range")
        for layer in layers:
            self._ledger.check_layer(entry, layer)
        if entry.doomed:
            self._fail(entry, INJECTED_FAILURE)
            return
        job = self._jobs.get(request_id)
        if job is not None:
            try:
                local = range(layers.start - self._layers.start, layers.stop - self._layers.start)
                job.last_write = job.writer.write_layers(local, job.pairs)
            except RuntimeError as exc:  # e.g. a kernel launch error
                log.exception("CUDA IPC write of %s failed", request_id)
                self._fail(entry, f"CUDA IPC write failed: {exc}")
                return
        else:
            self._frames.queue_layers(entry, layers)
        for layer in layers:
            self._ledger.layer_sent(entry, layer)
        self._progress()

    def complete(
        self,
        request_id: str,
        metadata: dict[str, Any],
        payload: torch.Tensor | bytes | None = None,
    ) -> None:
        self._notices()
        entry = self._ledger.lookup(request_id)
        if entry is None:
            return
        self._ledger.check_complete(entry)
        job = self._jobs.get(request_id)
        if job is not None:
            job.completion = completion_frames(request_id, metadata, payload, self._senders)
        else:
            self._frames.queue_complete(entry, metadata, payload)
        self._progress()

    def abort(self, request_id: str, reason: str) -> None:
        entry = self._ledger.table.get(request_id)
        if entry is not None:
            self._fail(entry, reason, answered=True)

    def decline(self, request_id: str, dest_address: str, reason: str) -> None:
        self._cancelled.pop((dest_address, request_id), None)
        if self._ledger.table.get(request_id) is not None:
            return  # begun: abort() ends it
        dest = self._connected(dest_address)  # no handshake: nothing will be written
        if dest is not None:
            notice = AbortHeader(request_id, reason, answered=True, senders=self._senders)
            self._send(dest_address, [encode_header(notice)])

    def flush(self) -> None:
        """Wait for every queued copy (direct writes and staging), then send what is ready."""
        for job in self._jobs.values():
            # query(), not synchronize(): a subclass's writes (nixl) progress only when asked.
            while job.last_write is not None and not job.last_write.query():
                time.sleep(FLUSH_POLL_S)
        self._frames.synchronize()
        self._progress()

    def poll(self) -> list[Transfer]:
        self._notices()
        self._progress()
        for entry in self._ledger.table.overdue(time.monotonic()):
            self._fail(entry, DEADLINE_EXCEEDED)
        return self._ledger.table.drain()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for job in self._jobs.values():  # no copy may still touch either pool after close
            if job.last_write is not None:
                job.last_write.synchronize()
        self._jobs.clear()
        self._frames.close()
        for dest in self._destinations.values():
            dest.socket.close(linger=self._linger_ms)  # frames mode: as zmq_transport
        self._destinations.clear()  # drops the opened remote pools
        self._ctx.term()

    # -- progress and failure -------------------------------------------------------------------
    def _progress(self) -> None:
        """Send what became ready: queued frames in order, then finished direct transfers."""
        self._frames.flush()
        for request_id, job in list(self._jobs.items()):
            if job.completion is None:
                continue
            if job.last_write is not None and not job.last_write.query():
                continue
            del self._jobs[request_id]
            entry = self._ledger.table.get(request_id)
            if entry is None:
                continue
            if self._send(job.address, job.completion):
                self._ledger.table.finish(request_id, TransferState.DONE)
            else:
                self._fail(entry, f"send queue to {job.address} is full")

    def _fail(self, entry: Outgoing, reason: str, answered: bool = False) -> None:
        """FAILED here, abort there (`answered`: by the node's abort()), after the copies still
        touching the request's blocks."""
        job = self._jobs.pop(entry.transfer.request_id, None)
        if job is not None and job.last_write is not None:
            job.last_write.synchronize()
        self._frames.fail(entry, reason, answered)

    # -- sockets, handshake, notices ------------------------------------------------------------
    def _destination(self, address: str) -> _Destination | None:
        """The receiver's socket, handshaken (None if the address is unusable)."""
        dest = self._connected(address)
        if dest is not None and dest.route is None:
            self._handshake(dest)
        return dest

    def _connected(self, address: str) -> _Destination | None:
        dest = self._destinations.get(address)
        if dest is None:
            sock = connect(self._ctx, zmq.DEALER, address)
            if sock is None:
                return None
            sock.setsockopt(zmq.LINGER, 0)
            dest = self._destinations[address] = _Destination(address, sock)
        return dest

    # What a subclass with another direct path (nixl) replaces: the handshake replies it
    # understands, how it opens the path a reply offers, and how it names that path in logs.
    EXPORTS: tuple[type, ...] = (PoolExport, RankExports, NoExport)
    TRANSPORT, DIRECT_PATH = "cuda_ipc", "CUDA IPC"

    def _open(self, reply: Any) -> tuple[DirectWriter | None, str]:
        """The direct path a handshake reply offers, or None and why there is none."""
        if isinstance(reply, NoExport):
            return None, reply.reason
        if self._side is None:
            return None, f"the local pool is on {self._pool.device.type}, not a GPU"
        if isinstance(reply, RankExports):
            targets = reply.targets()
        else:  # a decode node of one rank: its pool holds every KV head of the model
            targets = [(reply, range(reply.shape[4] if len(reply.shape) == 6 else 0))]
        mine = self._heads
        try:
            remotes = [  # the pools that hold some of this pool's heads, from its first layer
                (_from_layer(open_pool(export, self._pool), self._layers), heads)
                for export, heads in targets
                if heads.start < mine.stop and mine.start < heads.stop
            ]
            return DirectWriter(self._pool, mine, remotes, self._side), ""
        except IpcUnavailable as exc:
            return None, str(exc)

    def _handshake(self, dest: _Destination) -> None:
        reply = None
        if self._send(dest.address, [encode_message(Hello(host_id(), os.getpid()))]):
            reply = self._await_export(dest)
        if reply is None:
            dest.writer, dest.session = None, ""
            reason = f"no answer to the handshake within {HANDSHAKE_TIMEOUT_S} s"
        else:
            dest.session = reply.session
            dest.writer, reason = self._open(reply)
        if dest.writer is None:
            dest.route = Route(direct=False, reason=reason, device="")
            log.warning(
                "%s: KV to %s goes as frames through host memory, not %s: %s",
                self.TRANSPORT, dest.address, self.DIRECT_PATH, reason,
            )  # fmt: skip
        else:
            dest.route = Route(direct=True, reason="", device=str(dest.writer.holder))
            log.info("%s: KV to %s is written straight into its pool", self.TRANSPORT, dest.address)

    def _await_export(self, dest: _Destination) -> Any:
        """The receiver's answer to "hello" (one of EXPORTS), None if none came in time."""
        until = time.monotonic() + HANDSHAKE_TIMEOUT_S
        while (left := until - time.monotonic()) > 0:
            if not dest.socket.poll(math.ceil(left * 1000)):
                return None
            message = self._receive(dest)
            if isinstance(message, self.EXPORTS):
                return message
            if isinstance(message, Cancel):
                self._on_notice(dest, message)
        return None

    def _notices(self) -> None:
        for dest in list(self._destinations.values()):
            for _ in range(MAX_MESSAGES_PER_POLL):
                if not dest.socket.poll(0):
                    break
                message = self._receive(dest)
                if message is not None:
                    self._on_notice(dest, message)

    def _receive(self, dest: _Destination) -> Any:
        """One message from the receiver, None if none is waiting or it does not decode."""
        try:
            frames = dest.socket.recv_multipart(zmq.NOBLOCK)
            return decode_message(frames[0])
        except zmq.Again:
            return None
        except FrameError as exc:
            log.debug("dropped malformed message from %s: %s", dest.address, exc)
            return None

    def _on_notice(self, dest: _Destination, message: Any) -> None:
        if isinstance(message, Cancel):
            entry = self._ledger.table.get(message.request_id)
            if entry is None:
                self._cancelled[dest.address, message.request_id] = message.reason
                while len(self._cancelled) > REMEMBERED_CANCELS:
                    self._cancelled.popitem(last=False)
            elif entry.dest_address == dest.address:
                self._fail(entry, _cancelled(message.reason))
        elif isinstance(message, Reset):
            log.warning("cuda_ipc: %s: %s", dest.address, message.reason)
            for request_id, job in list(self._jobs.items()):
                entry = self._ledger.table.get(request_id)
                if job.address == dest.address and entry is not None:
                    self._fail(entry, f"receiver reset: {message.reason}")
            dest.route, dest.writer = None, None  # the next begin() there handshakes again
        # Anything else (a late handshake reply, a receiver-bound kind) needs no action.

    def _socket(self, address: str) -> zmq.Socket | None:
        dest = self._destinations.get(address)
        return None if dest is None else dest.socket

    def _send(self, address: str, frames: list[Any]) -> bool:
        return self._frames.send(address, frames)


def _cancelled(reason: str) -> str:
    return f"{CANCELLED_BY_RECEIVER}: {reason}" if reason else CANCELLED_BY_RECEIVER


def _from_layer(opened: OpenedPool, layers: range) -> OpenedPool:
    """The remote pool seen from a pipeline stage's first layer (the stage's pool layer 0),
    so the copy kernels index both pools alike."""
    if layers.start == 0 and opened.tensor.shape[0] == len(layers):
        return opened
    view = opened.tensor[layers.start : layers.stop]
    return dataclasses.replace(opened, tensor=view)
