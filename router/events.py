"""Events from the nodes, routed to one asyncio queue per in-flight request (no sockets here).

A request's queue receives its `FirstToken`, `TokenOutput`s and `RequestError`, plus a
router-made `NodeLost` when a node holding it dies. Events for ids that are not open (finished,
aborted, never ours) are dropped: after an abort a node may still send a few.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from common.protocol.messages import FirstToken, RequestError, TokenBatch, TokenOutput


@dataclass(frozen=True)
class NodeLost:
    node_id: str
    reason: str


RequestEvent = FirstToken | TokenOutput | RequestError | NodeLost


@dataclass
class _Open:
    queue: asyncio.Queue[RequestEvent]
    nodes: frozenset[str]


class EventRouter:
    def __init__(self) -> None:
        self._open: dict[str, _Open] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._open

    def __len__(self) -> int:
        return len(self._open)

    def open(self, request_id: str, nodes: Iterable[str]) -> asyncio.Queue[RequestEvent]:
        if request_id in self._open:
            raise ValueError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self._open[request_id] = _Open(queue, frozenset(nodes))
        return queue

    def close(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    def forget_node(self, request_id: str, node_id: str) -> None:
        """The request no longer depends on `node_id`: its loss will not fail the request."""
        entry = self._open.get(request_id)
        if entry is not None:
            entry.nodes = entry.nodes - {node_id}

    def deliver(self, message: Any) -> int:
        """Put a node's event on its request's queue; returns how many events were queued."""
        if isinstance(message, (FirstToken, RequestError)):
            return self._put(message.request_id, message)
        if isinstance(message, TokenBatch):  # checked whole when it was decoded
            return sum(self._put(output.request_id, output) for output in message.items())
        return 0

    def node_lost(self, node_id: str, reason: str) -> list[str]:
        """Tell every open request that involves `node_id` that it is gone; returns their ids."""
        hit = [rid for rid, entry in self._open.items() if node_id in entry.nodes]
        for rid in hit:
            self._open[rid].queue.put_nowait(NodeLost(node_id, reason))
        return hit

    def _put(self, request_id: str, event: RequestEvent) -> int:
        entry = self._open.get(request_id)
        if entry is None:
            return 0
        entry.queue.put_nowait(event)
        return 1
