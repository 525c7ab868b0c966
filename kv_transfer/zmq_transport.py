"""ZMQ transport: PUSH per destination on the sender, one bound PULL on the receiver.

Wire format, one multipart message per frame kind (headers: kv_transfer.frames):
  [layer header, payload]  payload = pool[layer][:, src_ids] as raw bytes, sent zero-copy
  [complete header(, payload)]  after every layer; a payload only when the header sizes one
  [abort header]
ZMQ keeps per-connection order, so "complete" arrives after all of its layers.

Both halves are the frames wire as it stands (kv_transfer.frames_sender, frames_receiver): on
CUDA a layer's frames wait in the sender's queue until its asynchronous device-to-host copy
finished, and are handed to zmq by the next send_layer, complete or poll, in order. Sender-side
DONE means the completion notice was handed to zmq, not that the receiver has it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import zmq

from kv_transfer.base import KVReceiver, KVSender, Transfer, TransferConfig, TransferState
from kv_transfer.frames_receiver import FrameReceiver
from kv_transfer.frames_sender import FrameSender, connect
from kv_transfer.ledger import DEADLINE_EXCEEDED, INJECTED_FAILURE
from kv_transfer.pool_io import PoolWriter, sender_ledger


class ZmqSender(KVSender):
    def __init__(self, pool: torch.Tensor, config: TransferConfig) -> None:
        self._ledger = sender_ledger(config, pool)
        self._linger_ms = round(config.close_linger_s * 1000)
        self._ctx = zmq.Context()
        self._sockets: dict[str, zmq.Socket] = {}
        self._frames = FrameSender(pool, self._ledger, config, self._socket)
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
            self._frames.fail(entry, INJECTED_FAILURE)
            return
        self._frames.queue_layers(entry, [layer])
        self._ledger.layer_sent(entry, layer)
        self._frames.flush()

    def complete(
        self,
        request_id: str,
        metadata: dict[str, Any],
        payload: torch.Tensor | bytes | None = None,
    ) -> None:
        entry = self._ledger.lookup(request_id)
        if entry is None:
            return
        self._ledger.check_complete(entry)
        self._frames.queue_complete(entry, metadata, payload)
        self._frames.flush()

    def abort(self, request_id: str, reason: str) -> None:
        entry = self._ledger.table.get(request_id)
        if entry is not None:
            self._frames.fail(entry, reason, answered=True)

    def flush(self) -> None:
        self._frames.synchronize()
        self._frames.flush()

    def poll(self) -> list[Transfer]:
        self._frames.flush()
        for entry in self._ledger.table.overdue(time.monotonic()):
            self._frames.fail(entry, DEADLINE_EXCEEDED)
        return self._ledger.table.drain()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._frames.close()  # no copy may still read the pool after close
        for sock in self._sockets.values():
            sock.close(linger=self._linger_ms)  # a DONE transfer's frames may still be queued
        self._ctx.term()

    def _socket(self, address: str) -> zmq.Socket | None:
        sock = self._sockets.get(address)
        if sock is None:
            sock = connect(self._ctx, zmq.PUSH, address)
            if sock is not None:
                self._sockets[address] = sock
        return sock


class ZmqReceiver(KVReceiver):
    def __init__(self, pool: torch.Tensor, config: TransferConfig, bind_address: str) -> None:
        self._frames = FrameReceiver(pool, config, bind_address, zmq.PULL)
        self._ledger = self._frames.ledger
        self.address = self._frames.address

    def expect(self, request_id: str, block_ids: list[int]) -> Transfer:
        return self._ledger.expect(request_id, block_ids)

    def poll(self, timeout_s: float = 0.0) -> list[Transfer]:
        return self._frames.poll(timeout_s, self._handle, self._ledger.expire)

    def cancel(self, request_id: str) -> bool:
        self._ledger.table.forget(request_id)
        return True  # only this receiver writes the pool, and it drops the request's frames

    def set_writer(self, writer: PoolWriter) -> None:
        """Before any expect(): a tensor-parallel node's writer, which knows every head."""
        self._frames.set_writer(writer)

    def close(self) -> None:
        self._frames.close()

    def _handle(self, frames: list[zmq.Frame]) -> None:
        header = self._frames.decode(frames, self._ledger.fail)
        if header is not None:
            self._frames.deliver(header, frames)
