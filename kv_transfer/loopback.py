"""In-process transport for tests: same state machine and validation as ZMQ, no sockets.

A receiver registers itself under its bind address `loopback://NAME`. The sender copies each
layer straight from its pool into the receiver's pool (after the receiver validated the frame
against its reservation, under the receiver's lock), and delivers completion and abort notices
as encoded headers (a completion with its payload, as a byte view) through the receiver's inbox, which the receiver decodes in poll() exactly
as it would a ZMQ frame. Sender and receiver may live in different threads.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch

from kv_transfer.base import KVReceiver, KVSender, Transfer, TransferConfig, TransferState
from kv_transfer.frames import (
    AbortHeader,
    CompleteHeader,
    FrameError,
    LayerHeader,
    completion_error,
    decode_header,
    encode_header,
)
from kv_transfer.ledger import DEADLINE_EXCEEDED, INJECTED_FAILURE, Outgoing
from kv_transfer.pool_io import (
    gather_layer,
    payload_error,
    payload_view,
    receiver_ledger,
    scatter_layer,
    sender_ledger,
)

SCHEME = "loopback://"

_RECEIVERS: dict[str, LoopbackReceiver] = {}
_RECEIVERS_LOCK = threading.Lock()


class LoopbackReceiver(KVReceiver):
    def __init__(self, pool: torch.Tensor, config: TransferConfig, bind_address: str) -> None:
        if not bind_address.startswith(SCHEME) or bind_address == SCHEME:
            raise ValueError(f"loopback address must look like {SCHEME}NAME, got {bind_address!r}")
        self._pool = pool
        self._ledger = receiver_ledger(config, pool)
        self._cond = threading.Condition()  # guards the ledger, the pool writes and the inbox
        self._inbox: deque[tuple[bytes, memoryview | None]] = deque()  # header, payload
        with _RECEIVERS_LOCK:
            if bind_address in _RECEIVERS:
                raise ValueError(f"loopback address {bind_address!r} is already bound")
            _RECEIVERS[bind_address] = self
        self.address = bind_address

    def expect(self, request_id: str, block_ids: list[int]) -> Transfer:
        with self._cond:
            return self._ledger.expect(request_id, block_ids)

    def poll(self, timeout_s: float = 0.0) -> list[Transfer]:
        with self._cond:
            self._process_inbox()
            table = self._ledger.table
            wait = table.wait_time(timeout_s)
            if wait is not None:
                self._cond.wait(wait)
                self._process_inbox()
            return table.drain()

    def cancel(self, request_id: str) -> bool:
        with self._cond:
            self._ledger.table.forget(request_id)
        return True  # layers are written under this receiver's lock, which now drops them

    def withdraw(self, request_id: str) -> None:
        self.cancel(request_id)

    def close(self) -> None:
        with _RECEIVERS_LOCK:
            if _RECEIVERS.get(self.address) is self:
                del _RECEIVERS[self.address]

    # -- called by LoopbackSender -----------------------------------------------------------
    def write_layer(self, header: LayerHeader, payload: torch.Tensor) -> None:
        """Validate a layer against the reservation and copy it into the pool."""
        with self._cond:
            entry = self._ledger.accept_layer(header)
            if entry is not None:
                nbytes = payload.numel() * payload.element_size()
                error = payload_error(self._pool, header, nbytes)
                if error is not None:
                    self._ledger.fail(header.request_id, error)
                else:
                    scatter_layer(self._pool, header.layer, header.block_ids, payload)
                    self._ledger.layer_written(entry, header.layer, nbytes=nbytes)
            self._cond.notify_all()

    def deliver(self, frame: bytes, payload: memoryview | None = None) -> None:
        """Queue an encoded completion (and its payload) or abort header for the next poll()."""
        with self._cond:
            self._inbox.append((frame, payload))
            self._cond.notify_all()

    def _process_inbox(self) -> None:
        while self._inbox:
            frame, payload = self._inbox.popleft()
            try:
                header = decode_header(frame)
            except FrameError as exc:
                if exc.request_id is not None:
                    self._ledger.fail(exc.request_id, f"malformed frame: {exc}")
                else:
                    self._ledger.malformed_frames += 1
                continue
            if isinstance(header, CompleteHeader):
                parts, nbytes = (1, None) if payload is None else (2, payload.nbytes)
                error = completion_error(header, parts, nbytes)
                if error is not None:
                    self._ledger.fail(header.request_id, f"malformed frame: {error}")
                else:
                    self._ledger.complete(header.request_id, header.metadata, payload=payload)
            elif isinstance(header, AbortHeader):
                self._ledger.abort(header.request_id, header.reason, header.answered)
            else:
                self._ledger.fail(header.request_id, "layer frame without payload")
        self._ledger.expire()


class LoopbackSender(KVSender):
    def __init__(self, pool: torch.Tensor, config: TransferConfig) -> None:
        self._pool = pool
        self._ledger = sender_ledger(config, pool)
        self._format = None if config.kv_format is None else config.kv_format.to_dict()

    def begin(
        self,
        request_id: str,
        dest_address: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
    ) -> Transfer:
        return self._ledger.begin(request_id, dest_address, src_block_ids, dst_block_ids).transfer

    def send_layer(self, request_id: str, layer: int) -> None:
        entry = self._ledger.lookup(request_id)
        if entry is None:
            return
        self._ledger.check_layer(entry, layer)
        receiver = _RECEIVERS.get(entry.dest_address)
        if entry.doomed or receiver is None:
            reason = INJECTED_FAILURE if entry.doomed else f"no receiver at {entry.dest_address}"
            self._fail(entry, reason)
            return
        payload = gather_layer(self._pool, layer, entry.transfer.block_ids)
        announce = self._format if not entry.layers else None  # the first layer's frame
        header = LayerHeader(
            request_id, layer, entry.dst_block_ids, str(payload.dtype), list(payload.shape),
            kv_format=announce,
        )  # fmt: skip
        receiver.write_layer(header, payload)
        self._ledger.layer_sent(entry, layer)

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
        view = None if payload is None else payload_view(payload)
        size = 0 if view is None else view.nbytes
        frame = encode_header(CompleteHeader(request_id, metadata, payload_bytes=size))
        receiver = _RECEIVERS.get(entry.dest_address)
        if receiver is None:
            self._fail(entry, f"no receiver at {entry.dest_address}")
            return
        receiver.deliver(frame, view if size else None)
        self._ledger.table.finish(request_id, TransferState.DONE)

    def abort(self, request_id: str, reason: str) -> None:
        entry = self._ledger.table.get(request_id)
        if entry is not None:
            self._fail(entry, reason, answered=True)

    def poll(self) -> list[Transfer]:
        for entry in self._ledger.table.overdue(time.monotonic()):
            self._fail(entry, DEADLINE_EXCEEDED)
        return self._ledger.table.drain()

    def close(self) -> None:
        pass  # nothing held: receivers belong to their owners

    def _fail(self, entry: Outgoing, reason: str, answered: bool = False) -> None:
        request_id = entry.transfer.request_id
        self._ledger.table.finish(request_id, TransferState.FAILED, reason)
        receiver = _RECEIVERS.get(entry.dest_address)
        if receiver is not None:
            receiver.deliver(encode_header(AbortHeader(request_id, reason, answered)))
