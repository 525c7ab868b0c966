"""The sending half of the frames wire (headers: kv_transfer.frames), shared by the zmq transport
and cuda_ipc's frames mode. Each transport owns its sockets; this owns the queue in front of them.

A layer is gathered into host memory (`HostStager`: asynchronously on CUDA) and queued as
[layer header, payload]; "complete" (with its payload frame, if any) is queued behind the
request's layers. Queued messages go to
their receiver's socket in queue order, each once its device-to-host copy finished, so every
connection keeps its requests' order. Sends never block: a full send queue (the receiver stopped
reading) fails that transfer. DONE means the completion notice was handed to zmq (the bytes are
out of the pool by then), not that the receiver has it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from kv_transfer.base import TransferConfig, TransferState
from kv_transfer.frames import AbortHeader, CompleteHeader, LayerHeader, encode_header
from kv_transfer.ledger import Outgoing, SenderLedger
from kv_transfer.pool_io import HostStager, as_bytes, payload_view

log = logging.getLogger(__name__)

# Messages (not bytes) buffered per connection; a transfer is num_layers + 1 messages. High
# enough for bursts of prefills, low enough to bound host memory if a receiver stops reading.
SEND_HWM = 1024


def connect(ctx: zmq.Context, socket_type: int, address: str) -> zmq.Socket | None:
    """A socket connected to the receiver at `address`; None (after a warning) if zmq refuses."""
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    try:
        sock.connect(address)
    except zmq.ZMQError as exc:
        log.warning("cannot connect to KV receiver %r: %s", address, exc)
        sock.close(linger=0)
        return None
    return sock


@dataclass
class _Queued:
    entry: Outgoing
    frames: list[Any]
    ready: torch.cuda.Event | None  # the device-to-host copy the payload waits for
    completes: bool  # the completion notice: DONE once handed to zmq


class FrameSender:
    """The frames of every transfer a sender ships as frames, in the order they were queued.

    `socket_of(address)` is the transport's connected socket to a receiver (None: unusable).
    Called from the sender's one thread."""

    def __init__(
        self,
        pool: torch.Tensor,
        ledger: SenderLedger,
        config: TransferConfig,
        socket_of: Callable[[str], zmq.Socket | None],
    ) -> None:
        self._pool, self._ledger, self._socket_of = pool, ledger, socket_of
        self._stager = HostStager(pool.device)
        # Tensor parallel: this rank's pool holds the model's KV heads from head_start on;
        # `senders` ranks each ship theirs (TransferConfig).
        self._head_start, self._senders = config.head_start, config.senders
        self._layer_start = config.layer_start  # pipeline stage: model layer of pool layer 0
        self._format = None if config.kv_format is None else config.kv_format.to_dict()
        self._queue: deque[_Queued] = deque()

    def queue_layers(self, entry: Outgoing, layers: Iterable[int]) -> None:
        """Stage the layers (final by now) of a transfer the ledger let through. The first
        layer frame of the transfer announces the pool's KV format."""
        announce = self._format if not entry.layers else None
        for layer in layers:
            local = layer - self._layer_start
            payload, ready = self._stager.stage(self._pool, local, entry.transfer.block_ids)
            header = LayerHeader(
                entry.transfer.request_id, layer, entry.dst_block_ids, str(payload.dtype),
                list(payload.shape), self._head_start, announce,
            )  # fmt: skip
            announce = None
            frames = [encode_header(header), as_bytes(payload)]
            self._queue.append(_Queued(entry, frames, ready, completes=False))

    def queue_complete(
        self, entry: Outgoing, metadata: dict[str, Any], payload: torch.Tensor | bytes | None
    ) -> None:
        """ValueError (nothing queued) if `metadata` cannot be packed or `payload` is not on
        the host. The payload goes zero-copy; the queue, then zmq, keep it alive until sent."""
        frames = completion_frames(entry.transfer.request_id, metadata, payload, self._senders)
        self._queue.append(_Queued(entry, frames, None, completes=True))

    def flush(self) -> None:
        """Hand ready frames to zmq in queue order (which keeps each connection's order)."""
        while self._queue:
            head = self._queue[0]
            if head.ready is not None and not head.ready.query():
                return
            self._queue.popleft()
            address = head.entry.dest_address
            if not self.send(address, head.frames):
                self.fail(head.entry, f"send queue to {address} is full")
            elif head.completes:
                self._ledger.table.finish(head.entry.transfer.request_id, TransferState.DONE)

    def fail(self, entry: Outgoing, reason: str, answered: bool = False) -> None:
        """FAILED here, abort there (`answered`: by the node's abort()). Waits for copies still
        reading the entry's source blocks, so the caller may free them as soon as it sees the
        failure."""
        kept: deque[_Queued] = deque()
        for queued in self._queue:
            if queued.entry is not entry:
                kept.append(queued)
            elif queued.ready is not None:
                queued.ready.synchronize()
        self._queue = kept
        request_id = entry.transfer.request_id
        self._ledger.table.finish(request_id, TransferState.FAILED, reason)
        notice = AbortHeader(request_id, reason, answered, self._senders)
        self.send(entry.dest_address, [encode_header(notice)])

    def send(self, address: str, frames: list[Any]) -> bool:
        sock = self._socket_of(address)
        if sock is None:
            return False
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # Again: queue full; anything else: a broken socket
            log.warning("send to %s failed: %s", address, exc)
            return False
        return True

    def synchronize(self) -> None:
        """Wait until no staging copy reads the pool any more."""
        self._stager.synchronize()

    def close(self) -> None:
        """Drop what is still queued; afterwards no copy reads the pool."""
        self._queue.clear()
        self._stager.synchronize()


def completion_frames(
    request_id: str,
    metadata: dict[str, Any],
    payload: torch.Tensor | bytes | None,
    senders: int = 1,
) -> list[Any]:
    """[complete header] or [complete header, payload]; ValueError as `KVSender.complete`."""
    view = None if payload is None else payload_view(payload)
    size = 0 if view is None else view.nbytes
    header = encode_header(CompleteHeader(request_id, metadata, senders, size))
    return [header] if not size else [header, view]
