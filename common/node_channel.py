"""A node process's control sockets: its own inbox, a line to the router, lines to peers.

Every node binds one PULL socket (its control address, which is also its node id) and
PUSHes to the router's events socket and to peer nodes' control sockets. Frames that fail
validation are logged and dropped: a bad message never stops a node.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from typing import Any

import zmq

from common.messages import Heartbeat, MessageError, decode, encode

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5


class NodeChannel:
    def __init__(self, control_address: str, router_address: str, role: str) -> None:
        self.context = zmq.Context.instance()
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(control_address)
        self.node_id = control_address
        self.role = role
        self.router = self._push(router_address)
        self.peers: dict[str, zmq.Socket] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self._last_heartbeat = 0.0

    def _push(self, address: str) -> zmq.Socket:
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return sock

    def receive(self, timeout_s: float) -> list[Any]:
        """Every message waiting in the inbox; waits up to `timeout_s` for the first one."""
        messages: list[Any] = []
        if not self.poller.poll(int(timeout_s * 1000)):
            return messages
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            try:
                messages.append(decode(frame))
            except MessageError as exc:
                log.warning("dropped an invalid control message: %s", exc)

    def to_router(self, message: Any) -> None:
        self.router.send(encode(message))

    def to_peer(self, address: str, message: Any) -> None:
        sock = self.peers.get(address)
        if sock is None:
            sock = self.peers[address] = self._push(address)
        sock.send(encode(message))

    def maybe_heartbeat(self, info: dict[str, Any], load: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat >= HEARTBEAT_INTERVAL_S:
            self._last_heartbeat = now
            self.to_router(Heartbeat(self.node_id, self.role, info, load))

    def close(self) -> None:
        for sock in [self.inbox, self.router, *self.peers.values()]:
            sock.close(linger=0)


def runtime_info(runtime: Any, **extra: Any) -> dict[str, Any]:
    info = asdict(runtime)
    info["eos_token_ids"] = list(info["eos_token_ids"])
    info["pid"] = os.getpid()
    info.update(extra)
    return info
