"""Which nodes exist, which are alive, and what they last reported (pure Python, no sockets).

The nodes are fixed by the command line; a node becomes healthy with its first valid
heartbeat and is dead once `timeout` seconds pass without one. Every method takes `now`
(a monotonic timestamp) explicitly, so liveness is testable without sleeping.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from common.messages import Heartbeat

log = logging.getLogger(__name__)

# Info keys that identify one process lifetime; a change means the node restarted and lost
# whatever it held. Nodes that send none of them are only caught restarting by the timeout.
INSTANCE_KEYS = ("instance_id", "started_at", "pid")


@dataclass
class NodeState:
    node_id: str
    role: str  # the role the command line gave: "prefill" | "decode" | "colocated"
    info: dict[str, Any] = field(default_factory=dict)
    load: dict[str, Any] = field(default_factory=dict)
    last_heartbeat: float | None = None
    alive: bool = False  # as last reported by observe/sweep, so each death is reported once
    problem: str | None = None  # why a heartbeating node cannot be used

    def healthy(self, now: float, timeout: float) -> bool:
        return (
            self.problem is None
            and self.last_heartbeat is not None
            and now - self.last_heartbeat <= timeout
        )

    def load_value(self, key: str) -> int:
        value = self.load.get(key, 0)
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


class NodeRegistry:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str], timeout: float) -> None:
        decode_role = "decode" if prefill else "colocated"
        self.timeout = timeout
        self.nodes: dict[str, NodeState] = {n: NodeState(n, "prefill") for n in prefill}
        self.nodes.update({n: NodeState(n, decode_role) for n in decode})
        self._warned: set[str] = set()

    @property
    def colocated(self) -> bool:
        return all(n.role == "colocated" for n in self.nodes.values())

    def observe(self, hb: Heartbeat, now: float) -> bool:
        """Record a heartbeat. True when the node's in-flight requests are lost: it had gone
        silent past the timeout (even if no sweep noticed yet) or it restarted."""
        node = self.nodes.get(hb.node_id)
        if node is None:
            if hb.node_id not in self._warned:
                self._warned.add(hb.node_id)
                log.warning("heartbeat from %s, which is not on the command line", hb.node_id)
            return False
        lapsed = node.alive and node.last_heartbeat is not None
        lapsed = lapsed and now - node.last_heartbeat > self.timeout
        restarted = any(
            key in node.info and node.info[key] != hb.info.get(key) for key in INSTANCE_KEYS
        )
        problem = self._problem(node, hb)
        if problem and problem != node.problem:
            log.error("node %s is unusable: %s", node.node_id, problem)
        node.info, node.load, node.last_heartbeat = dict(hb.info), dict(hb.load), now
        node.problem = problem
        if not node.alive and node.problem is None:
            log.info("node %s (%s) is up", node.node_id, node.role)
        node.alive = node.problem is None
        return lapsed or restarted

    def sweep(self, now: float) -> list[str]:
        """Nodes that died since the last sweep (each reported once)."""
        dead = []
        for node in self.nodes.values():
            if node.alive and not node.healthy(now, self.timeout):
                node.alive = False
                dead.append(node.node_id)
                log.error("node %s missed heartbeats for %.1f s: dead", node.node_id, self.timeout)
        return dead

    def healthy(self, role: str, now: float) -> list[NodeState]:
        return [n for n in self.nodes.values() if n.role == role and n.healthy(now, self.timeout)]

    def has_path(self, now: float) -> bool:
        """A request can be served: a healthy colocated node, or a healthy prefill and decode."""
        if self.colocated:
            return bool(self.healthy("colocated", now))
        return bool(self.healthy("prefill", now)) and bool(self.healthy("decode", now))

    def report(self, now: float) -> list[dict[str, Any]]:
        out = []
        for node in self.nodes.values():
            age = None if node.last_heartbeat is None else round(now - node.last_heartbeat, 3)
            entry = {
                "id": node.node_id,
                "role": node.role,
                "healthy": node.healthy(now, self.timeout),
                "last_heartbeat_age_s": age,
                "pid": (node.info or {}).get("pid"),
                "device": (node.info or {}).get("device"),
                "info": node.info,
                "load": node.load,
            }
            if node.problem:
                entry["problem"] = node.problem
            out.append(entry)
        return out

    @staticmethod
    def _problem(node: NodeState, hb: Heartbeat) -> str | None:
        if hb.role != node.role:
            return f"reports role {hb.role!r}, but the command line lists it as {node.role!r}"
        for key in ("max_model_len", "vocab_size"):
            value = hb.info.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                return f"heartbeat info has no positive integer {key!r}"
        if node.role == "decode" and not isinstance(hb.info.get("kv_address"), str):
            return "heartbeat info has no 'kv_address'"
        return None
