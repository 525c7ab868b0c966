"""Which nodes exist, which are alive, and what they last reported (pure Python, no sockets).

Nodes given on the command line are seeds, known from the start; any other node registers
with its first heartbeat (its control address is its id, its role the one it reports). A node
becomes healthy with its first valid heartbeat and is dead once `timeout` seconds pass
without one; a dead node that was not a seed is forgotten after `forget_after` seconds. A
node that comes back (same address: a restart is detected by its changed pid / instance id)
is admitted again. A draining node (it got SIGTERM) is alive but gets no new requests. Every
method takes `now` (a monotonic timestamp) explicitly, so liveness is testable without
sleeping. A prefill and a decode node exchange KV only if their heartbeats' `kv_format` are
equal (`kv_mismatch`); the registry logs each mismatched pair once, when it first sees it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from common.engine.kv_format import KVFormat
from common.protocol.messages import Heartbeat

log = logging.getLogger(__name__)

# Info keys that identify one process lifetime; a change means the node restarted and lost
# whatever it held. Nodes that send none of them are only caught restarting by the timeout.
INSTANCE_KEYS = ("instance_id", "started_at", "pid")


@dataclass
class NodeState:
    node_id: str
    role: str  # "prefill" | "decode" | "colocated": from the command line, else the heartbeat
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

    @property
    def draining(self) -> bool:
        return self.load.get("draining") is True

    def routable(self, now: float, timeout: float) -> bool:
        """Healthy and taking new requests."""
        return self.healthy(now, timeout) and not self.draining

    def load_value(self, key: str) -> int:
        value = self.load.get(key, 0)
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


class NodeRegistry:
    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        timeout: float,
        *,
        colocated: bool,
        forget_after: float = 60.0,
    ) -> None:
        if colocated and prefill:
            raise ValueError(f"a colocated registry takes no prefill nodes, got {list(prefill)}")
        self.colocated = colocated
        self.timeout = timeout
        self.forget_after = forget_after
        decode_role = "colocated" if colocated else "decode"
        self.nodes: dict[str, NodeState] = {n: NodeState(n, "prefill") for n in prefill}
        self.nodes.update({n: NodeState(n, decode_role) for n in decode})
        self.seeds = frozenset(self.nodes)
        self._mismatches_logged: set[tuple[str, str, str]] = set()

    @property
    def roles(self) -> tuple[str, ...]:
        return ("colocated",) if self.colocated else ("prefill", "decode")

    def observe(self, hb: Heartbeat, now: float, judged_at: float | None = None) -> bool:
        """Record a heartbeat (registering a node not seen before). True when the node's
        in-flight requests are lost: it had gone silent past the timeout (even if no sweep
        noticed yet) or it restarted. Silence is judged up to `judged_at` (default `now`; the
        router passes the time its reader last caught up, RouterCore.liveness_now)."""
        node = self.nodes.get(hb.node_id)
        if node is None:
            node = self.nodes[hb.node_id] = NodeState(hb.node_id, hb.role)
            log.info("node %s (%s) registered", hb.node_id, hb.role)
        lapsed = node.alive and node.last_heartbeat is not None
        judged_at = now if judged_at is None else judged_at
        lapsed = lapsed and judged_at - node.last_heartbeat > self.timeout
        restarted = any(
            key in node.info and node.info[key] != hb.info.get(key) for key in INSTANCE_KEYS
        )
        problem = self._problem(node, hb)
        if problem and problem != node.problem:
            log.error("node %s is unusable: %s", node.node_id, problem)
        if hb.load.get("draining") is True and not node.draining:
            log.info("node %s is draining: no new requests", node.node_id)
        node.info, node.load, node.last_heartbeat = dict(hb.info), dict(hb.load), now
        node.problem = problem
        if not node.alive and node.problem is None:
            log.info("node %s (%s) is up", node.node_id, node.role)
        node.alive = node.problem is None
        if node.alive and node.role in ("prefill", "decode"):
            self._log_kv_mismatches(node)
        return lapsed or restarted

    def _log_kv_mismatches(self, node: NodeState) -> None:
        other_role = "decode" if node.role == "prefill" else "prefill"
        for other in self.nodes.values():
            if other.role != other_role or not other.alive:
                continue
            prefill, decode = (node, other) if node.role == "prefill" else (other, node)
            diff = kv_mismatch(prefill, decode)
            key = (prefill.node_id, decode.node_id, diff or "")
            if diff is not None and key not in self._mismatches_logged:
                self._mismatches_logged.add(key)
                log.error(
                    "prefill node %s and decode node %s cannot exchange KV (the router pairs "
                    "neither with the other): %s", prefill.node_id, decode.node_id, diff,
                )  # fmt: skip

    def sweep(self, now: float) -> list[str]:
        """Nodes that died since the last sweep (each reported once)."""
        dead = []
        for node in self.nodes.values():
            if node.alive and not node.healthy(now, self.timeout):
                node.alive = False
                dead.append(node.node_id)
                log.error("node %s missed heartbeats for %.1f s: dead", node.node_id, self.timeout)
        return dead

    def forget_stale(self, now: float) -> list[str]:
        """Drop nodes that are not seeds and have been silent for `forget_after` seconds."""
        stale = [
            n.node_id
            for n in self.nodes.values()
            if n.node_id not in self.seeds
            and not n.alive
            and (n.last_heartbeat is None or now - n.last_heartbeat > self.forget_after)
        ]
        for node_id in stale:
            del self.nodes[node_id]
            log.info("forgot node %s (silent for %.0f s)", node_id, self.forget_after)
        return stale

    def healthy(self, role: str, now: float) -> list[NodeState]:
        """Nodes of `role` that may take new requests (heartbeating in time, not draining)."""
        return [n for n in self.nodes.values() if n.role == role and n.routable(now, self.timeout)]

    def has_path(self, now: float) -> bool:
        """A request can be served: a healthy colocated node, or a healthy prefill and decode."""
        return all(self.healthy(role, now) for role in self.roles)

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
                "draining": node.draining,
                "load": node.load,
            }
            if node.problem:
                entry["problem"] = node.problem
            out.append(entry)
        return out

    def _problem(self, node: NodeState, hb: Heartbeat) -> str | None:
        if hb.role not in self.roles:
            mode = "colocated" if self.colocated else "pd"
            return f"reports role {hb.role!r}, which the router's {mode} mode does not use"
        if hb.role != node.role:
            return f"reports role {hb.role!r}, but the command line lists it as {node.role!r}"
        for key in ("max_model_len", "vocab_size"):
            value = hb.info.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                return f"heartbeat info has no positive integer {key!r}"
        if node.role == "decode" and not isinstance(hb.info.get("kv_address"), str):
            return "heartbeat info has no 'kv_address'"
        if "kv_format" in hb.info:
            try:
                KVFormat.from_dict(hb.info["kv_format"])
            except ValueError as exc:
                return f"heartbeat info has a malformed 'kv_format': {exc}"
        return None


def kv_mismatch(prefill: NodeState, decode: NodeState) -> str | None:
    """How the two nodes' KV pools differ, field by field with both values; None when KV may
    move between them. A node whose heartbeat names no format matches only another such."""
    mine, theirs = prefill.info.get("kv_format"), decode.info.get("kv_format")
    if mine == theirs:
        return None
    if mine is None or theirs is None:
        described = [KVFormat.from_dict(f).describe() if f else "unknown" for f in (mine, theirs)]
        return f"kv_format {described[0]} (prefill) vs {described[1]} (decode)"
    return KVFormat.from_dict(mine).mismatch(KVFormat.from_dict(theirs), ("prefill", "decode"))
