"""ZMQ transport: PUSH per destination on the sender, one bound PULL on the receiver.

Wire format, one multipart message per frame kind (headers: kv_transfer.frames):
  [layer header, payload]  payload = pool[layer][:, src_ids] as raw bytes, sent zero-copy
  [complete header]        after every layer of the request
  [abort header]
ZMQ keeps per-connection order, so "complete" arrives after all of its layers.

Sends never block the sender's event loop: a full send queue (the receiver stopped reading)
fails that transfer instead. On CUDA a layer's frames wait in the sender's queue until its
asynchronous device-to-host copy finished; they are handed to zmq by the next send_layer,
complete or poll, in order. Sender-side DONE means the completion notice was handed to zmq
(the bytes are out of the pool by then), not that the receiver has it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from kv_transfer.base import KVReceiver, KVSender, Transfer, TransferConfig, TransferState
from kv_transfer.frames import (
    AbortHeader,
    CompleteHeader,
    FrameError,
    LayerHeader,
    decode_header,
    encode_header,
)
from kv_transfer.ledger import (
    DEADLINE_EXCEEDED,
    INJECTED_FAILURE,
    Outgoing,
    ReceiverLedger,
    SenderLedger,
)
from kv_transfer.pool_io import HostStager, PoolWriter, as_bytes, write_layer_frame

log = logging.getLogger(__name__)

# Messages (not bytes) buffered per connection; a transfer is num_layers + 1 messages. High
# enough for bursts of prefills, low enough to bound host memory if a receiver stops reading.
SEND_HWM = 1024
RECV_HWM = 1024
MAX_MESSAGES_PER_POLL = 512  # bounds the time one receiver poll() takes under a flood


@dataclass
class _Queued:
    entry: Outgoing
    frames: list[Any]
    ready: torch.cuda.Event | None  # the device-to-host copy the payload waits for
    completes: bool  # the completion notice: DONE once handed to zmq


class ZmqSender(KVSender):
    def __init__(self, pool: torch.Tensor, config: TransferConfig) -> None:
        self._pool = pool
        self._ledger = SenderLedger(config, num_layers=pool.shape[0], num_blocks=pool.shape[2])
        self._stager = HostStager(pool.device)
        # Tensor parallel: this rank's pool holds the model's KV heads from head_start on;
        # `senders` ranks each ship theirs (TransferConfig).
        self._head_start, self._senders = config.head_start, config.senders
        self._linger_ms = round(config.close_linger_s * 1000)
        self._ctx = zmq.Context()
        self._sockets: dict[str, zmq.Socket] = {}
        self._queue: deque[_Queued] = deque()
        self._closed = False

    def begin(
        self,
        request_id: str,
        dest_address: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
    ) -> Transfer:
        entry = self._ledger.begin(request_id, dest_address, src_block_ids, dst_block_ids)
        if self._socket(dest_address) is None:
            self._ledger.table.finish(
                request_id, TransferState.FAILED, f"cannot connect to {dest_address!r}"
            )
        return entry.transfer

    def send_layer(self, request_id: str, layer: int) -> None:
        entry = self._ledger.lookup(request_id)
        if entry is None:
            return
        self._ledger.check_layer(entry, layer)
        if entry.doomed:
            self._fail(entry, INJECTED_FAILURE)
            return
        payload, ready = self._stager.stage(self._pool, layer, entry.transfer.block_ids)
        header = LayerHeader(
            request_id, layer, entry.dst_block_ids, str(payload.dtype), list(payload.shape),
            self._head_start,
        )  # fmt: skip
        self._queue.append(_Queued(entry, [encode_header(header), as_bytes(payload)], ready, False))
        self._ledger.layer_sent(entry, layer)
        self._flush()

    def complete(self, request_id: str, metadata: dict[str, Any]) -> None:
        entry = self._ledger.lookup(request_id)
        if entry is None:
            return
        self._ledger.check_complete(entry)
        frame = encode_header(CompleteHeader(request_id, metadata, self._senders))
        self._queue.append(_Queued(entry, [frame], None, True))
        self._flush()

    def abort(self, request_id: str, reason: str) -> None:
        entry = self._ledger.table.get(request_id)
        if entry is not None:
            self._fail(entry, reason, answered=True)

    def flush(self) -> None:
        self._stager.synchronize()
        self._flush()

    def poll(self) -> list[Transfer]:
        self._flush()
        for entry in self._ledger.table.overdue(time.monotonic()):
            self._fail(entry, DEADLINE_EXCEEDED)
        return self._ledger.table.drain()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.clear()
        self._stager.synchronize()  # no copy may still read the pool after close
        for sock in self._sockets.values():
            sock.close(linger=self._linger_ms)  # a DONE transfer's frames may still be queued
        self._ctx.term()

    # -- internals --------------------------------------------------------------------------
    def _flush(self) -> None:
        """Hand ready frames to zmq in queue order (which keeps each connection's order)."""
        while self._queue:
            head = self._queue[0]
            if head.ready is not None and not head.ready.query():
                return
            self._queue.popleft()
            address = head.entry.dest_address
            if not self._send(address, head.frames):
                self._fail(head.entry, f"send queue to {address} is full")
            elif head.completes:
                self._ledger.table.finish(head.entry.transfer.request_id, TransferState.DONE)

    def _fail(self, entry: Outgoing, reason: str, answered: bool = False) -> None:
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
        abort = AbortHeader(request_id, reason, answered)
        self._send(entry.dest_address, [encode_header(abort)])

    def _send(self, address: str, frames: list[Any]) -> bool:
        sock = self._socket(address)
        if sock is None:
            return False
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # Again: queue full; anything else: a broken socket
            log.warning("send to %s failed: %s", address, exc)
            return False
        return True

    def _socket(self, address: str) -> zmq.Socket | None:
        sock = self._sockets.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            try:
                sock.connect(address)
            except zmq.ZMQError as exc:
                log.warning("cannot connect to KV receiver %r: %s", address, exc)
                sock.close(linger=0)
                return None
            self._sockets[address] = sock
        return sock


class ZmqReceiver(KVReceiver):
    def __init__(self, pool: torch.Tensor, config: TransferConfig, bind_address: str) -> None:
        self._pool = pool
        self._ledger = ReceiverLedger(
            config, num_layers=pool.shape[0], num_blocks=pool.shape[2], num_heads=pool.shape[4]
        )
        self.writer = PoolWriter(pool)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, RECV_HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(bind_address)  # "tcp://127.0.0.1:0" picks a free port
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise ValueError(f"cannot bind KV receiver to {bind_address!r}: {exc}") from None
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._closed = False

    def expect(self, request_id: str, block_ids: list[int]) -> Transfer:
        return self._ledger.expect(request_id, block_ids)

    def poll(self, timeout_s: float = 0.0) -> list[Transfer]:
        self._receive_available()
        self._expire()
        table = self._ledger.table
        wait = table.wait_time(timeout_s)  # bounded by deadlines (and cancel grace periods)
        if wait is not None:
            if self._sock.poll(math.ceil(wait * 1000)):
                self._receive_available()
            self._expire()
        return table.drain()

    def cancel(self, request_id: str) -> bool:
        self._ledger.table.forget(request_id)
        return True  # only this receiver writes the pool, and it drops the request's frames

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.close(linger=0)
        self._ctx.term()

    # -- internals --------------------------------------------------------------------------
    def _expire(self) -> None:
        for entry in self._ledger.table.overdue(time.monotonic()):
            self._ledger.fail(entry.transfer.request_id, DEADLINE_EXCEEDED)

    def _receive_available(self) -> None:
        for _ in range(MAX_MESSAGES_PER_POLL):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        """Act on one message; a bad one fails its transfer (if it names one) or is dropped."""
        try:
            header = decode_header(frames[0].bytes)
        except FrameError as exc:
            if exc.request_id is not None:
                self._ledger.fail(exc.request_id, f"malformed frame: {exc}")
            else:
                self._ledger.malformed_frames += 1
                log.debug("dropped malformed KV frame: %s", exc)
            return
        parts = 2 if isinstance(header, LayerHeader) else 1
        if len(frames) != parts:
            self._ledger.fail(header.request_id, f"message has {len(frames)} parts, not {parts}")
        elif isinstance(header, LayerHeader):
            self._write_layer(header, frames[1].buffer)
        elif isinstance(header, CompleteHeader):
            self._ledger.complete(header.request_id, header.metadata, header.senders)
        else:
            self._ledger.abort(header.request_id, header.reason, header.answered)

    def set_writer(self, writer: PoolWriter) -> None:
        """Before any expect(): a tensor-parallel node's writer, which knows every head."""
        self.writer = writer
        self._ledger.num_heads = writer.num_heads

    def _write_layer(self, header: LayerHeader, buffer: memoryview) -> None:
        write_layer_frame(self.writer, self._ledger, header, buffer)
