"""The one loop a node process runs, whatever its role, and the process's entry point.

Each iteration: receive control messages (waiting as long as the role allows) and hand each to
the role, run an engine step if the role has work, poll the role's transport (KV sender or
receiver), expire requests past their deadline (every EXPIRY_INTERVAL_S), publish the load.
The transport is polled after the engine step so that what the step finished (a prefill
node's completion notices, a decode node's admissions) moves on in the same iteration.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from common.envs import setup_logging
from common.node.channel import NodeChannel
from common.node.config import NodeConfig, parse_node_args
from common.node.lifecycle import Lifecycle
from common.node.profiling import profiled

log = logging.getLogger(__name__)

EXPIRY_INTERVAL_S = 0.1  # how often requests are checked against their deadlines


class NodeRole(Protocol):
    """What a prefill or decode node plugs into `NodeLoop`."""

    def inbox_wait(self) -> float:
        """Seconds the inbox may wait for messages in this iteration (0: work is ready)."""

    def handle(self, message: object, decode_s: float) -> None:
        """One control message; `decode_s`: how long parsing it took."""

    def has_work(self) -> bool: ...

    def engine_step(self) -> None: ...

    def poll_transport(self) -> None: ...

    def expire(self, now: float) -> None:
        """End the requests whose deadline is before `now` (monotonic)."""

    def load(self) -> dict[str, Any]: ...

    def idle(self) -> bool:
        """Holds no request: a draining node may exit."""

    def close(self) -> None:
        """Release the role's transport and engine (the loop closes the channel)."""


class NodeLoop:
    def __init__(self, role: NodeRole, channel: NodeChannel, drain_timeout_s: float) -> None:
        self.role = role
        self.channel = channel
        self.lifecycle = Lifecycle(drain_timeout_s)
        self._last_expiry = 0.0

    def run(self, info: dict[str, Any]) -> None:
        """Serve until stopped or drained; `info`: the heartbeat's static part."""
        self.lifecycle.install_signal_handlers()
        log.info("%s node %s ready", self.channel.role, self.channel.node_id)
        self.channel.start_heartbeat(info, self.load())
        try:
            while not self.lifecycle.should_exit(idle=self.role.idle()):
                self.step()
        finally:
            self.role.close()
            self.channel.close()

    def stop(self) -> None:
        self.lifecycle.stop()

    def step(self) -> None:
        for message, decode_s in self.channel.receive_timed(timeout_s=self.role.inbox_wait()):
            self.role.handle(message, decode_s)
        if self.role.has_work():
            self.role.engine_step()
        self.role.poll_transport()
        now = time.monotonic()
        if now - self._last_expiry >= EXPIRY_INTERVAL_S:
            self._last_expiry = now
            self.role.expire(now)
        self.channel.publish_load(self.load)

    def load(self) -> dict[str, Any]:
        return {**self.role.load(), "draining": self.lifecycle.draining}


def serve(role_name: str, make_node: Callable[[NodeConfig, Any], Any]) -> None:
    """A node process's main: logging, flags, profiling, then `make_node(...).run()`."""
    setup_logging(role_name)
    node_config, engine_config = parse_node_args(f"pdserve {role_name} node")
    with profiled(role_name):
        make_node(node_config, engine_config).run()
