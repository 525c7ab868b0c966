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

Tensor parallel (kv_transfer.tp): each shipping prefill rank is a sender of its own, on its own
connection, and every notice says how many ranks send (`senders`). A direct "start" names the
KV heads its sender writes; the decode node's rank 0 answers "hello" with every rank's pool
(`share_ranks`), so a direct sender writes its heads into each rank's pool itself, while frames
reach the other ranks through rank 0's writer. The ledger counts heads: DONE once every rank's
"complete" arrived and every head of every layer is in (a direct "complete" vouches for its
heads of every layer). Senders may mix modes.

Ending a request from the decode side (cancel(), deadline, malformed message, a sender's abort
while other ranks send): while a sender may be writing the blocks itself (direct mode, or not
every sender has spoken yet), the receiver sends "cancel" to each sender still going (to every
connected sender while some are unknown), keeps the blocks, and reports the transfer FAILED
only once each sender answered "abort" (sent after its queued copies finished) or "complete",
or after CANCEL_GRACE_S without an answer. A sender remembers cancels of requests it has not
begun, and fails their begin() at once, so no write starts afterwards. Every failure passes
this hold (`ReceiverLedger.hold`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
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
    NoExport,
    PoolExport,
    RankExports,
    Reset,
    Start,
    encode_message,
    export_or_refusal,
    forget_export,
    host_id,
)
from kv_transfer.ipc_sender import CudaIpcSender, Route
from kv_transfer.ledger import DEADLINE_EXCEEDED
from kv_transfer.pool_io import PoolWriter

__all__ = ["CANCEL_GRACE_S", "CANCELLED", "CudaIpcReceiver", "CudaIpcSender", "Route"]

log = logging.getLogger(__name__)

CANCEL_GRACE_S = 10.0  # how long cancelled blocks stay held when the sender never answers
CANCELLED = "cancelled"
MAX_PEERS = 4096  # senders remembered for cancel broadcasts (a DEALER reconnect is a new peer)


@dataclass
class _Senders:
    """Who writes one request's blocks: each sending prefill rank, by its connection."""

    expected: int = 1  # sending ranks, as their messages say
    direct: dict[bytes, range] = field(default_factory=dict)  # writes the pool: its heads
    layers: dict[bytes, range | None] = field(default_factory=dict)  # ... of these layers
    frames: set[bytes] = field(default_factory=set)  # its bytes come through this receiver
    stopped: set[bytes] = field(default_factory=set)  # its "abort" or "complete" arrived
    told: set[bytes] = field(default_factory=set)  # sent a "cancel"

    def known(self) -> set[bytes]:
        return self.direct.keys() | self.frames | self.stopped

    def quiet(self) -> bool:
        """Nobody writes the blocks any more: every sender spoke, each direct one stopped."""
        return len(self.known()) >= self.expected and self.direct.keys() <= self.stopped


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
        self._ledger.hold = self._hold
        self.address = self._frames.address
        self._grace_s = cancel_grace_s
        self._session = secrets.token_hex(8)
        self._export = self._export_pool(pool)  # once: the pool never moves
        self._peers: OrderedDict[bytes, None] = OrderedDict()  # said hello, newest last
        self._senders: dict[str, _Senders] = {}  # active requests, once a sender spoke
        self._held: dict[str, str] = {}  # request -> the error it will be reported with

    def _export_pool(self, pool: torch.Tensor) -> Any:
        """The answer to every "hello": how a sender may write `pool` itself, or why not."""
        return export_or_refusal(pool, self._session)

    @property
    def pool_export(self) -> Any:
        """This pool's export (or why there is none), as `share_ranks` takes it."""
        return self._export

    def set_writer(self, writer: PoolWriter) -> None:
        """Before any expect(): a tensor-parallel node's writer, which knows every head."""
        self._frames.set_writer(writer)

    def share_ranks(self, exports: list[Any], heads: list[range]) -> None:
        """Rank 0 of a tensor-parallel decode node, before any expect(): answer "hello" with
        every rank's pool (`exports` in rank order, this one's first; rank r's pool holds the
        model's KV heads `heads[r]`). Frames when one rank cannot export."""
        refusal = next((e for e in exports if not isinstance(e, PoolExport)), None)
        if refusal is not None:
            rank = exports.index(refusal)
            reason = getattr(refusal, "reason", "no export")
            self._export = NoExport(self._session, host_id(), f"decode rank {rank}: {reason}")
            return
        spans = [[h.start, h.stop] for h in heads]
        self._export = RankExports(self._session, host_id(), list(exports), spans)

    def expect(self, request_id: str, block_ids: list[int]) -> Transfer:
        return self._ledger.expect(request_id, block_ids)

    def poll(self, timeout_s: float = 0.0) -> list[Transfer]:
        finished = self._frames.poll(timeout_s, self._handle, self._expire)
        for transfer in finished:
            self._forget(transfer.request_id)
        return finished

    def cancel(self, request_id: str) -> bool:
        if request_id in self._held:
            return False
        if self._ledger.table.get(request_id) is not None and self._hold(request_id, CANCELLED):
            return False
        self._ledger.table.forget(request_id)
        self._forget(request_id)
        return True

    def withdraw(self, request_id: str) -> None:
        super().withdraw(request_id)
        self._forget(request_id)

    def close(self) -> None:
        forget_export(self._session)
        self._frames.close()

    # -- holding blocks a sender may still write -------------------------------------------------
    def _hold(self, request_id: str, error: str) -> bool:
        """The ledger's `hold` (the transfer is active): ask each sender still going to stop.
        False when nobody can write the blocks any more (fail it now); else True: it stays
        active until they confirmed (`_release`) or the grace period ended, then FAILED with
        the first `error`."""
        if request_id in self._held:
            return True
        senders = self._senders.setdefault(request_id, _Senders())
        self._tell(request_id, senders)
        if senders.quiet():
            return False
        self._held[request_id] = error
        entry = self._ledger.table.get(request_id)
        assert entry is not None  # the ledger asks only about active transfers
        entry.transfer.deadline = time.monotonic() + self._grace_s
        return True

    def _tell(self, request_id: str, senders: _Senders) -> None:
        """ "cancel" to the senders still going: the known ones once all spoke, else every
        connected sender too."""
        known = senders.known()
        targets = known if len(known) >= senders.expected else known | self._peers.keys()
        for identity in targets - senders.stopped - senders.told:
            self._cancel(identity, request_id, senders)

    def _cancel(self, identity: bytes, request_id: str, senders: _Senders, why: str = "") -> None:
        """`why`: the sender's own error names it (a refusal only this side can explain)."""
        senders.told.add(identity)
        self._send(identity, Cancel(request_id, why))

    def _release(self, request_id: str) -> None:
        """A held transfer whose senders all stopped: FAILED now."""
        senders = self._senders.get(request_id)
        if request_id in self._held and senders is not None and senders.quiet():
            self._ledger.fail_now(request_id, self._held.pop(request_id))

    def _expire(self) -> None:
        for entry in self._ledger.table.overdue(time.monotonic()):
            request_id = entry.transfer.request_id
            error = self._held.pop(request_id, None)
            if error is None:
                self._ledger.fail(request_id, DEADLINE_EXCEEDED)
            else:  # the grace period ended without an answer: the sender is gone
                log.warning("no answer to the cancel of %s; reusing its blocks", request_id)
                self._ledger.fail_now(request_id, error)

    def _forget(self, request_id: str) -> None:
        self._senders.pop(request_id, None)
        self._held.pop(request_id, None)

    # -- messages ------------------------------------------------------------------------------
    def _handle(self, routed: list[zmq.Frame]) -> None:
        if len(routed) < 2:  # the ROUTER puts the sender's identity first
            return
        identity, frames = routed[0].bytes, routed[1:]
        message = self._frames.decode(frames, self._ledger.fail, ALL_KINDS)
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
            senders = self._spoke(message.request_id, 1)
            if senders is not None and identity not in senders.direct:
                senders.frames.add(identity)
            if message.request_id not in self._held:
                self._frames.write_layer(message, frames)
        elif isinstance(message, (CompleteHeader, AbortHeader)):
            self._ended(identity, message, frames)
        else:
            log.debug("dropped a %s message sent to a KV receiver", type(message).__name__)

    def _spoke(self, request_id: str, senders: int) -> _Senders | None:
        """The senders of an active request, one of which just announced `senders` in all."""
        if self._ledger.table.get(request_id) is None:
            return None
        record = self._senders.setdefault(request_id, _Senders())
        record.expected = max(record.expected, senders)
        return record

    def _start(self, identity: bytes, start: Start) -> None:
        request_id = start.request_id
        senders = self._spoke(request_id, start.senders)
        if senders is None:
            return  # unexpected or already ended: nothing to start
        if start.direct and start.session != self._session:
            # It writes through an export of an earlier receiver at this address: not our pool.
            self._send(identity, Reset("the receiver restarted; connect again"))
            senders.frames.add(identity)
            senders.stopped.add(identity)
            if request_id in self._held:
                self._release(request_id)
            else:
                self._ledger.fail(request_id, "the sender wrote through a stale pool export")
            return
        refusal = None
        if start.direct:
            heads, refusal = self._heads(start.heads)
            senders.direct[identity] = heads
            senders.layers[identity] = range(*start.layers) if start.layers else None
        else:
            senders.frames.add(identity)
        if request_id in self._held:
            if identity not in senders.told:  # it connected after the broadcast
                self._cancel(identity, request_id, senders)
            self._release(request_id)
            return
        entry = self._ledger.table.get(request_id)
        assert entry is not None  # _spoke found it
        refusal = refusal or self._ledger.check_format(entry, start.kv_format)
        if refusal is not None:
            # A direct sender may be writing already: its blocks stay held until it confirms.
            self._cancel(identity, request_id, senders, refusal)
            self._ledger.fail(request_id, refusal)
        else:
            self._ledger.started(request_id)

    def _heads(self, span: list[int] | None) -> tuple[range, str | None]:
        """The KV heads a direct "start" names (None: all), or why they cannot be."""
        num_heads = self._ledger.num_heads
        if span is None:
            return range(num_heads), None
        heads = range(*span) if len(span) == 2 else range(0)
        if not len(heads) or heads.start < 0 or heads.stop > num_heads:
            return heads, f"a direct sender's KV heads {span} are outside [0, {num_heads})"
        return heads, None

    def _ended(
        self, identity: bytes, message: CompleteHeader | AbortHeader, frames: list[zmq.Frame]
    ) -> None:
        """A sender's "complete" or "abort": it writes nothing more for that request."""
        request_id = message.request_id
        senders = self._spoke(request_id, message.senders)
        if senders is not None:
            senders.stopped.add(identity)
        if request_id in self._held:
            self._release(request_id)
        elif isinstance(message, AbortHeader):
            self._ledger.abort(request_id, message.reason, message.answered)
        elif senders is not None and identity in senders.direct:
            heads = senders.direct[identity]
            self._ledger.complete_written(
                request_id, message.metadata, completion_payload(frames), heads, message.senders,
                senders.layers.get(identity),
            )  # fmt: skip
        else:
            self._ledger.complete(
                request_id, message.metadata, message.senders, completion_payload(frames)
            )

    def _send(self, identity: bytes, message: Any) -> None:
        try:
            self._frames.sock.send_multipart([identity, encode_message(message)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a peer that went away or stopped reading
            log.debug("could not send %s to a KV sender: %s", type(message).__name__, exc)
