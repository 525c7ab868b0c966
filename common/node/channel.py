"""A node process's control sockets: its own inbox, a line to the router, lines to peers.

Every node binds one PULL socket (its control address, which is also its node id) and
PUSHes to the router's events socket and to peer nodes' control sockets. Frames that fail
validation are logged and dropped: a bad message never stops a node.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import zmq

from common.protocol.messages import Heartbeat, MessageError, decode, encode

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
PEER_SEND_HWM = 1000  # control messages queued for one peer node before to_peer drops them


def _host_id() -> str:
    """Identifies this host and boot: processes with equal ids share CLOCK_MONOTONIC."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"


HOST_ID = _host_id()
LOAD_REFRESH_S = 0.05


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
        self.router_address = router_address
        self._heartbeat: HeartbeatThread | None = None
        self._last_load = 0.0
        self.invalid_messages = 0  # frames dropped as invalid (undecodable, unsigned, mistyped)
        self.undelivered_messages = 0  # messages to a peer dropped: its queue was full

    def _push(self, address: str, send_hwm: int | None = None) -> zmq.Socket:
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        if send_hwm is not None:
            sock.setsockopt(zmq.SNDHWM, send_hwm)  # before connect: it sizes the pipe
        try:
            sock.connect(address)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def receive(self, timeout_s: float) -> list[Any]:
        """Every message waiting in the inbox; waits up to `timeout_s` for the first one."""
        return [message for message, _ in self.receive_timed(timeout_s)]

    def receive_timed(self, timeout_s: float) -> list[tuple[Any, float]]:
        """`receive`, each message with the seconds its decoding (parsing and validation)
        took: the node_decode phase of the timing record."""
        messages: list[tuple[Any, float]] = []
        if not self.poller.poll(int(timeout_s * 1000)):
            return messages
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            start = time.monotonic()
            try:
                message = decode(frame)
            except MessageError as exc:
                self.invalid_messages += 1
                log.warning("dropped an invalid control message: %s", exc)
                continue
            messages.append((message, time.monotonic() - start))

    def to_router(self, message: Any) -> None:
        self.router.send(encode(message))

    def to_peer(self, address: str, message: Any) -> bool:
        """Send to a peer node's control socket without blocking. False (logged, counted) when
        `address`, which came in a message, is no address at all, or when PEER_SEND_HWM
        messages already wait for that peer (it is gone or stuck): a node loop must never
        hang on a peer."""
        sock = self.peers.get(address)
        if sock is None:
            try:
                sock = self._push(address, PEER_SEND_HWM)
            except zmq.ZMQError as exc:
                log.warning("cannot connect to peer %r: %s", address, exc)
                return False
            self.peers[address] = sock
        try:
            sock.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            self.undelivered_messages += 1
            log.warning("peer %r takes no more messages: dropped a %s", address,
                        type(message).__name__)  # fmt: skip
            return False
        return True

    def start_heartbeat(self, info: dict[str, Any], load: dict[str, Any]) -> None:
        """Heartbeats go from their own thread (and socket), so a long model step can't make a
        healthy node look dead. The main loop only swaps in fresh load figures; `load` is the
        first, so that no heartbeat, the first included, comes without them."""
        self._heartbeat = HeartbeatThread(
            self.context, self.router_address, self.node_id, self.role, info
        )
        self._heartbeat.load = load
        self._last_load = time.monotonic()
        self._heartbeat.start()

    def publish_load(self, measure: Callable[[], dict[str, Any]]) -> None:
        """Refresh the load figures the heartbeat thread reports (at most every LOAD_REFRESH_S)."""
        now = time.monotonic()
        if self._heartbeat is not None and now - self._last_load >= LOAD_REFRESH_S:
            self._last_load = now
            self._heartbeat.load = measure()  # one reference swap; the thread only reads it

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        for sock in [self.inbox, self.router, *self.peers.values()]:
            sock.close(linger=0)


def runtime_info(runtime: Any, **extra: Any) -> dict[str, Any]:
    info = asdict(runtime)
    info["eos_token_ids"] = list(info["eos_token_ids"])
    info["pid"] = os.getpid()
    info.update(extra)
    return info


class HeartbeatThread(threading.Thread):
    def __init__(
        self, context: zmq.Context, address: str, node_id: str, role: str, info: dict[str, Any]
    ) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.context, self.address = context, address
        self.node_id, self.role, self.info = node_id, role, info
        self.load: dict[str, Any] = {}
        self._stop_event = threading.Event()

    def run(self) -> None:
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.connect(self.address)
        try:
            while True:
                try:
                    sock.send(
                        encode(Heartbeat(self.node_id, self.role, self.info, self.load)),
                        zmq.NOBLOCK,
                    )
                except zmq.Again:
                    pass  # router not reading: drop this beat, the next one carries fresher load
                if self._stop_event.wait(HEARTBEAT_INTERVAL_S):
                    return
        finally:
            sock.close(linger=0)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=2)
