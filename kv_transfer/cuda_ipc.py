"""CUDA IPC transport: the prefill GPU writes KV straight into the decode node's pool.

Connection: the receiver binds one ZMQ ROUTER socket; each sender connects one DEALER per
receiver and, on its first begin() there (or connect()), says "hello" and waits up to
HANDSHAKE_TIMEOUT_S for the pool export (messages: kv_transfer.ipc_handles). The sender then
writes layers itself (kv_transfer.ipc_writer) and sends only small notices on the socket. When
IPC cannot work (other host, CPU pool, GPU not visible, no peer access, layouts differ, the
handle does not open, no reply) it falls back, with one warning per receiver, to the zmq wire
format on the same socket: [layer header, payload] frames staged through pinned host memory.

One request, on the socket (ZMQ keeps each connection's order):
  "start" (mode: direct or frames)  [layer frames, frames mode]  "complete" | "abort"
"complete" may carry a payload frame (KVSender.complete), in either mode.
"start" announces the sender's KV format; one the receiver's pool does not hold fails the
transfer there (`ReceiverLedger.check_format`) and the sender is told why in a "cancel".
Direct mode: the sender sends "complete" only once the events of all its writes completed, so
sender-side DONE and receiver-side DONE both mean the bytes are in the decode pool. Frames mode
behaves like zmq_transport (sender DONE = the notice was handed to zmq).

Ending a request from the decode side (cancel(), deadline, malformed message): while a sender
may be writing the blocks itself (direct mode, or no "start" seen yet), the receiver sends it
"cancel" (to every connected sender when the writer is unknown), keeps the blocks, and reports
the transfer FAILED only when the sender answers "abort" (sent after its queued copies
finished) or "complete", or after CANCEL_GRACE_S without an answer. A sender remembers cancels
of requests it has not begun, and fails their begin() at once, so no write starts afterwards.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from kv_transfer.base import KVReceiver, Transfer, TransferConfig
from kv_transfer.frames import AbortHeader, CompleteHeader, LayerHeader
from kv_transfer.frames_receiver import FrameReceiver, completion_payload
from kv_transfer.ipc_handles import (
    ALL_KINDS,
    Cancel,
    Hello,
    IpcUnavailable,
    NoExport,
    Reset,
    Start,
    encode_message,
    export_pool,
    forget_export,
    host_id,
)
from kv_transfer.ipc_sender import CudaIpcSender, Route
from kv_transfer.ledger import DEADLINE_EXCEEDED

__all__ = ["CANCEL_GRACE_S", "CANCELLED", "CudaIpcReceiver", "CudaIpcSender", "Route"]

log = logging.getLogger(__name__)

CANCEL_GRACE_S = 10.0  # how long cancelled blocks stay held when the sender never answers
CANCELLED = "cancelled"
MAX_PEERS = 4096  # senders remembered for cancel broadcasts (a DEALER reconnect is a new peer)


@dataclass
class _Writer:
    identity: bytes  # the sender's DEALER, as the ROUTER names it
    direct: bool  # it writes the pool itself


class CudaIpcReceiver(KVReceiver):
    def __init__(
        self,
        pool: torch.Tensor,
        config: TransferConfig,
        bind_address: str,
        cancel_grace_s: float = CANCEL_GRACE_S,
    ) -> None:
        self._frames = FrameReceiver(pool, config, bind_address, zmq.ROUTER)
        self._ledger = self._frames.ledger
        self.address = self._frames.address
        self._grace_s = cancel_grace_s
        self._session = secrets.token_hex(8)
        self._export = self._export_pool(pool)  # once: the pool never moves
        self._peers: OrderedDict[bytes, None] = OrderedDict()  # said hello, newest last
        self._writers: dict[str, _Writer] = {}  # from each active request's "start"
        self._cancelling: dict[str, str] = {}  # request -> the error it will be reported with

    def _export_pool(self, pool: torch.Tensor) -> Any:
        """The answer to every "hello": how a sender may write `pool` itself, or why not."""
        try:
            return export_pool(pool, self._session)
        except IpcUnavailable as exc:
            return NoExport(self._session, host_id(), str(exc))

    def expect(self, request_id: str, block_ids: list[int]) -> Transfer:
        return self._ledger.expect(request_id, block_ids)

    def poll(self, timeout_s: float = 0.0) -> list[Transfer]:
        finished = self._frames.poll(timeout_s, self._handle, self._expire)
        for transfer in finished:
            self._writers.pop(transfer.request_id, None)
            self._cancelling.pop(transfer.request_id, None)
        return finished

    def cancel(self, request_id: str) -> bool:
        if request_id in self._cancelling:
            return False
        if self._stop(request_id, CANCELLED):
            self._ledger.table.forget(request_id)
            self._writers.pop(request_id, None)
            return True
        return False

    def close(self) -> None:
        forget_export(self._session)
        self._frames.close()

    # -- ending a transfer from this side ------------------------------------------------------
    def _stop(self, request_id: str, error: str, tell: bool = False) -> bool:
        """Stop a transfer this side gave up on. True: nobody writes its blocks any more (the
        caller fails or forgets it). False: a sender may; it is asked to stop and the transfer is
        reported FAILED(`error`) on its answer or when the grace period ends. `tell`: the
        sender's own error names `error` too (a refusal only this side can explain)."""
        entry = self._ledger.table.get(request_id)
        if entry is None:
            return True
        writer = self._writers.get(request_id)
        targets = [writer.identity] if writer is not None else list(self._peers)
        for identity in targets:
            self._send(identity, Cancel(request_id, error if tell else ""))
        if writer is not None and not writer.direct:
            return True  # frames mode: its bytes only reach the pool through this receiver
        self._cancelling[request_id] = error
        entry.transfer.deadline = time.monotonic() + self._grace_s
        return False

    def _fail(self, request_id: str, error: str) -> None:
        if self._stop(request_id, error):
            self._ledger.fail(request_id, error)

    def _expire(self) -> None:
        for entry in self._ledger.table.overdue(time.monotonic()):
            request_id = entry.transfer.request_id
            error = self._cancelling.get(request_id)
            if error is None:
                self._fail(request_id, DEADLINE_EXCEEDED)
            else:  # the grace period ended without an answer: the sender is gone
                log.warning("no answer to the cancel of %s; reusing its blocks", request_id)
                self._ledger.fail(request_id, error)

    def _confirmed(self, request_id: str) -> bool:
        """A sender's abort or complete ends a cancelled transfer: its writes are over."""
        error = self._cancelling.get(request_id)
        if error is not None:
            self._ledger.fail(request_id, error)
        return error is not None

    # -- messages ------------------------------------------------------------------------------
    def _handle(self, routed: list[zmq.Frame]) -> None:
        if len(routed) < 2:  # the ROUTER puts the sender's identity first
            return
        identity, frames = routed[0].bytes, routed[1:]
        message = self._frames.decode(frames, self._fail, ALL_KINDS)
        if message is None:
            return
        if isinstance(message, Hello):
            self._peers[identity] = None
            self._peers.move_to_end(identity)
            while len(self._peers) > MAX_PEERS:
                self._peers.popitem(last=False)
            self._send(identity, self._export)
        elif isinstance(message, Start):
            self._start(identity, message)
        elif isinstance(message, LayerHeader):
            if self._ledger.table.get(message.request_id) is not None:
                self._writers.setdefault(message.request_id, _Writer(identity, direct=False))
            if message.request_id not in self._cancelling:
                self._frames.write_layer(message, frames)
        elif isinstance(message, CompleteHeader):
            writer = self._writers.get(message.request_id)
            if self._confirmed(message.request_id):
                pass
            elif writer is not None and writer.direct:
                self._ledger.complete_written(
                    message.request_id, message.metadata, completion_payload(frames)
                )
            else:
                self._ledger.complete(
                    message.request_id, message.metadata, payload=completion_payload(frames)
                )
        elif isinstance(message, AbortHeader):
            if not self._confirmed(message.request_id):
                self._ledger.abort(message.request_id, message.reason, message.answered)
        else:
            log.debug("dropped a %s message sent to a KV receiver", type(message).__name__)

    def _start(self, identity: bytes, start: Start) -> None:
        request_id = start.request_id
        entry = self._ledger.table.get(request_id)
        if entry is None:
            return  # unexpected or already ended: nothing to start
        self._writers[request_id] = _Writer(identity, start.direct)
        refusal = self._ledger.check_format(entry, start.kv_format)
        if start.direct and start.session != self._session:
            # It writes through an export of an earlier receiver at this address: not our pool.
            self._send(identity, Reset("the receiver restarted; connect again"))
            self._cancelling.pop(request_id, None)
            self._ledger.fail(request_id, "the sender wrote through a stale pool export")
        elif request_id in self._cancelling:
            self._send(identity, Cancel(request_id))  # it may have begun after the broadcast
            if not start.direct:
                self._ledger.fail(request_id, self._cancelling.pop(request_id))
        elif refusal is not None:
            # A direct sender may be writing already: its blocks stay held until it confirms.
            if self._stop(request_id, refusal, tell=True):
                self._ledger.fail(request_id, refusal)
        else:
            self._ledger.started(request_id)

    def _send(self, identity: bytes, message: Any) -> None:
        try:
            self._frames.sock.send_multipart([identity, encode_message(message)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a peer that went away or stopped reading
            log.debug("could not send %s to a KV sender: %s", type(message).__name__, exc)
