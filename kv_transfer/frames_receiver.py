"""The receiving half of the frames wire (headers: kv_transfer.frames), shared by the zmq
transport and cuda_ipc's receiver: one bound socket, the ledger of the transfers it expects, and
the writer of their layers. Nothing that arrives raises: a bad message fails the transfer it
names, or is counted and dropped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import zmq

from kv_transfer.base import Transfer, TransferConfig
from kv_transfer.frames import (
    KINDS,
    CompleteHeader,
    FrameError,
    LayerHeader,
    completion_error,
    decode_header,
)
from kv_transfer.pool_io import PoolWriter, receiver_ledger, write_layer_frame

log = logging.getLogger(__name__)

RECV_HWM = 1024  # messages buffered from all senders together
MAX_MESSAGES_PER_POLL = 512  # bounds the time one receiver poll() takes under a flood

Fail = Callable[[str, str], None]  # (request id, error): how the transport ends a transfer


class FrameReceiver:
    """Called from the receiver's one thread. `writer` writes every layer frame into the pool."""

    def __init__(
        self, pool: torch.Tensor, config: TransferConfig, bind_address: str, socket_type: int
    ) -> None:
        self.ledger = receiver_ledger(config, pool)
        self.writer = PoolWriter(pool)
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(socket_type)
        self.sock.setsockopt(zmq.RCVHWM, RECV_HWM)
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            self.sock.bind(bind_address)  # "tcp://127.0.0.1:0" picks a free port
        except zmq.ZMQError as exc:
            self.sock.close()
            self._ctx.term()
            raise ValueError(f"cannot bind KV receiver to {bind_address!r}: {exc}") from None
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._closed = False

    def set_writer(self, writer: PoolWriter) -> None:
        """Before any expect(): a tensor-parallel node's writer, which knows every head."""
        self.writer = writer
        self.ledger.num_heads = writer.num_heads

    def poll(
        self,
        timeout_s: float,
        handle: Callable[[list[zmq.Frame]], None],
        expire: Callable[[], None],
    ) -> list[Transfer]:
        """KVReceiver.poll: `handle` each arrived message, `expire` what is past its deadline,
        waiting up to `timeout_s` for news while there is nothing to return."""
        self._receive_available(handle)
        expire()
        wait = self.ledger.table.wait_time(timeout_s)  # bounded by deadlines and grace periods
        if wait is not None:
            if self.sock.poll(math.ceil(wait * 1000)):
                self._receive_available(handle)
            expire()
        return self.ledger.table.drain()

    def decode(
        self, frames: list[zmq.Frame], fail: Fail, kinds: Mapping[str, type] = KINDS
    ) -> Any | None:
        """The message's header if it decodes and has its number of parts (a layer header and
        its payload, a completion and the payload its header sizes, anything else alone); None
        once it failed its transfer or was dropped."""
        try:
            header = decode_header(frames[0].bytes, kinds)
        except FrameError as exc:
            if exc.request_id is not None:
                fail(exc.request_id, f"malformed frame: {exc}")
            else:
                self.ledger.malformed_frames += 1
                log.debug("dropped malformed KV message: %s", exc)
            return None
        if isinstance(header, CompleteHeader):
            nbytes = frames[1].buffer.nbytes if len(frames) > 1 else None
            error = completion_error(header, len(frames), nbytes)
            if error is not None:
                fail(header.request_id, f"malformed frame: {error}")
                return None
            return header
        parts = 2 if isinstance(header, LayerHeader) else 1
        if len(frames) != parts:
            request_id = getattr(header, "request_id", None)
            if request_id is not None:
                fail(request_id, f"message has {len(frames)} parts, not {parts}")
            return None
        return header

    def write_layer(self, header: LayerHeader, frames: list[zmq.Frame]) -> None:
        write_layer_frame(self.writer, self.ledger, header, frames[1].buffer)

    def deliver(self, header: Any, frames: list[zmq.Frame]) -> None:
        """A decoded frame into the pool and the ledger."""
        if isinstance(header, LayerHeader):
            self.write_layer(header, frames)
        elif isinstance(header, CompleteHeader):
            self.ledger.complete(
                header.request_id, header.metadata, header.senders, completion_payload(frames)
            )
        else:
            self.ledger.abort(header.request_id, header.reason, header.answered)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.sock.close(linger=0)
        self._ctx.term()

    def _receive_available(self, handle: Callable[[list[zmq.Frame]], None]) -> None:
        for _ in range(MAX_MESSAGES_PER_POLL):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handle(frames)


def completion_payload(frames: list[zmq.Frame]) -> memoryview | None:
    """A decoded completion's payload frame (its size checked by `decode`), without a copy:
    the view keeps the zmq frame alive."""
    return frames[1].buffer if len(frames) > 1 else None
