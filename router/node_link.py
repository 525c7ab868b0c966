"""The router's ZMQ sockets: one PULL for every node's events, one PUSH per node's control inbox.

Sends never block the event loop: a plain (non-asyncio) PUSH socket with NOBLOCK raises
`SendError` when the node's queue is full, which the caller turns into a 503 (dispatch) or
ignores (abort of a node that is already gone). Only the PULL socket is asyncio.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import zmq
import zmq.asyncio

from common.protocol.messages import MessageError, decode, encode

log = logging.getLogger(__name__)

SEND_HWM = 10_000  # messages queued per node before sends fail
CAUGHT_UP_MS = 100  # an idle reader reports that it caught up at least this often


class SendError(RuntimeError):
    pass


class NodeLink(Protocol):
    """What the router core needs from a transport (a test can pass any object with this)."""

    def send(self, node_id: str, message: Any) -> None: ...

    def connect(self, node_id: str) -> bool:
        """A node registered itself: open a line to its control address (False: impossible)."""
        return True

    def disconnect(self, node_id: str) -> None:
        """The node was forgotten: close its line (queued messages are dropped)."""


class ZmqNodeLink:
    def __init__(self, events_address: str, node_ids: Iterable[str]) -> None:
        self._ctx = zmq.asyncio.Context()
        self._events = self._ctx.socket(zmq.PULL)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.setsockopt(zmq.RCVHWM, 0)  # never push back on nodes: they must not block
        self._events.bind(events_address)
        self._controls: dict[str, zmq.Socket] = {}
        for node_id in node_ids:
            self.connect(node_id)

    def connect(self, node_id: str) -> bool:
        if node_id in self._controls:
            return True
        sock = zmq.Socket(self._ctx, zmq.PUSH)  # synchronous socket on the same context
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        try:
            sock.connect(node_id)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            log.warning("cannot connect to node %r: %s", node_id, exc)
            return False
        self._controls[node_id] = sock
        return True

    def disconnect(self, node_id: str) -> None:
        sock = self._controls.pop(node_id, None)
        if sock is not None:
            sock.close(linger=0)

    def send(self, node_id: str, message: Any) -> None:
        sock = self._controls.get(node_id)
        if sock is None:
            raise SendError(f"no control socket for node {node_id!r}")
        try:
            sock.send(encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise SendError(f"cannot send to node {node_id}: {exc}") from None

    async def run(
        self, on_message: Callable[[Any], None], on_caught_up: Callable[[], None] | None = None
    ) -> None:
        """Read events until cancelled; a bad frame or a failing handler never stops the loop.
        `on_caught_up` is called whenever no event is waiting (at least every CAUGHT_UP_MS):
        every event sent before then has been handled."""
        while True:
            if not self._events.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                if on_caught_up is not None:
                    on_caught_up()
                if not await self._events.poll(CAUGHT_UP_MS):
                    continue
            frame = await self._events.recv()
            try:
                message = decode(frame)
            except MessageError as exc:
                log.warning("dropped an invalid event frame: %s", exc)
                continue
            try:
                on_message(message)
            except Exception:
                log.exception("handling %s failed", type(message).__name__)

    def close(self) -> None:
        for sock in [self._events, *self._controls.values()]:
            sock.close(linger=0)
        self._ctx.term()
