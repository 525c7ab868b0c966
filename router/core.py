"""The router's shared state and its one view of the nodes: registry, load ledger, open
requests and the link. Everything runs on the event loop thread; nothing here blocks.

Per request: `route` picks the nodes (503 if no healthy path), `dispatch` sends DecodeRequest
to the decode node, then PrefillRequest to the prefill node, and opens the request's event
queue; `abort` tells every node of the route to drop it; `release` forgets it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.protocol.messages import (
    Abort,
    DecodeRequest,
    FirstToken,
    Heartbeat,
    PrefillRequest,
    int_array,
)
from router.admission import Admission
from router.config import RouterConfig
from router.errors import OpenAIError
from router.events import EventRouter, RequestEvent
from router.metrics import NodeCollector, RouterMetrics
from router.node_link import NodeLink, SendError
from router.policy import Candidate, LoadLedger, create_policy
from router.prepare import ModelLimits, PreparedRequest
from router.registry import NodeRegistry, NodeState, kv_mismatch

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class Route:
    prefill: str | None  # None: the decode node is colocated and prefills itself
    decode: str
    decode_kv_address: str | None
    limits: ModelLimits
    block_size: int

    @property
    def nodes(self) -> tuple[str, ...]:
        return (self.decode,) if self.prefill is None else (self.prefill, self.decode)


class RouterCore:
    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        link: NodeLink | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.link = link  # None until the sockets are up (app startup)
        self.clock = clock
        # When the link's reader last found its socket empty (None: no asynchronous reader,
        # events are handed in as they happen): see liveness_now.
        self._events_read_at: float | None = None
        self.registry = NodeRegistry(
            config.prefill,
            config.decode,
            config.heartbeat_timeout,
            colocated=config.colocated,
            forget_after=config.forget_node_after_s,
        )
        self.events = EventRouter()
        self.ledger = LoadLedger()
        self.admission = Admission(config.max_waiting_requests, config.retry_after_s)
        metrics.add_collector(NodeCollector(metrics.model_name, self._node_snapshot))
        self.policies = {
            pool: create_policy(name, pool, config.policy_config())
            for pool, name in (("prefill", config.prefill_policy), ("decode", config.decode_policy))
        }

    def on_message(self, message: Any) -> None:
        """Handle one validated message from the events socket."""
        if isinstance(message, Heartbeat):
            new = message.node_id not in self.registry.nodes
            if new and self.link is not None and not self.link.connect(message.node_id):
                return  # not an address a socket can reach: no node the router can use
            if self.registry.observe(message, self.clock(), self.liveness_now()):
                self._lose(message.node_id, "restarted or was silent past the heartbeat timeout")
            node = self.registry.nodes.get(message.node_id)
            if node is not None and node.role != "prefill":
                self.ledger.decode_reported(node.node_id)
            return
        if isinstance(message, FirstToken):
            self.ledger.prefill_done(message.request_id)
        self.events.deliver(message)

    def events_read(self) -> None:
        """The link's reader found no event waiting: every event sent before now was handled."""
        self._events_read_at = self.clock()

    def liveness_now(self) -> float:
        """The time heartbeats are judged at: when the reader last caught up with its socket,
        not the clock, so that a stall of the router's own loop (a long import, a long
        request preparation) is not taken for its nodes' silence, which would fail requests
        of healthy nodes. Bounded: under a flood the reader may never find the socket empty,
        and a node that died then is found at most one heartbeat timeout late."""
        now = self.clock()
        if self._events_read_at is None:
            return now
        return min(now, max(self._events_read_at, now - self.config.heartbeat_timeout))

    def sweep(self) -> list[str]:
        """Fail the requests of nodes that stopped heartbeating; returns those nodes."""
        now = self.liveness_now()
        dead = self.registry.sweep(now)
        for node_id in dead:
            self._lose(node_id, f"no heartbeat for {self.config.heartbeat_timeout} s")
        for node_id in self.registry.forget_stale(now):
            if self.link is not None:
                self.link.disconnect(node_id)
        return dead

    async def sweep_forever(self) -> None:
        interval = min(0.25, self.config.heartbeat_timeout / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                self.sweep()
            except Exception:
                log.exception("liveness sweep failed")

    def route(self, prompt: list[int]) -> Route:
        if self.link is None:
            raise OpenAIError(503, "the router is starting up")
        now = self.liveness_now()
        if self.registry.colocated:
            decode_role, prefills = "colocated", []
        else:
            decode_role, prefills = "decode", self.registry.healthy("prefill", now)
            if not prefills:
                raise OpenAIError(
                    503, "no healthy prefill node (none has sent a heartbeat in time)"
                )
        decodes = self.registry.healthy(decode_role, now)
        if not decodes:
            raise OpenAIError(
                503, f"no healthy {decode_role} node (none has sent a heartbeat in time)"
            )
        partners: dict[str, list[NodeState]] = {}  # decode node -> prefill nodes of its KV
        if prefills:
            partners = {d.node_id: [p for p in prefills if not kv_mismatch(p, d)] for d in decodes}
            decodes = [d for d in decodes if partners[d.node_id]]
            if not decodes:
                raise _no_kv_partners(prefills, self.registry.healthy("decode", now))
        decode = self._choose("decode", [self._decode_candidate(n) for n in decodes], prompt)
        prefill = None
        if prefills:
            candidates = [self._prefill_candidate(n) for n in partners[decode.node_id]]
            prefill = self._choose("prefill", candidates, prompt)
        chosen = [n for n in (prefill, decode) if n is not None]
        limits = ModelLimits(
            max_model_len=min(n.info["max_model_len"] for n in chosen),
            vocab_size=min(n.info["vocab_size"] for n in chosen),
        )
        size = decode.info.get("block_size")
        block_size = size if isinstance(size, int) and size > 0 else DEFAULT_BLOCK_SIZE
        return Route(
            prefill=None if prefill is None else prefill.node_id,
            decode=decode.node_id,
            decode_kv_address=decode.info.get("kv_address"),
            limits=limits,
            block_size=block_size,
        )

    def dispatch(
        self,
        request_id: str,
        prepared: PreparedRequest,
        route: Route,
        deadline_s: float | None = None,
    ) -> asyncio.Queue[RequestEvent]:
        """Send the request to its nodes and open its event queue. A pool with too many
        requests waiting gives a 429 (nothing sent), a send failure a 503; on any failure the
        queue is closed again and the nodes told to drop the request."""
        assert self.link is not None, "route() refuses to run before the link exists"
        pd = route.prefill is not None
        self.admission.check(pd)
        ids = int_array(prepared.prompt_token_ids)  # converted once, sent as raw int32 bytes
        sampling = prepared.params
        queue = self.events.open(request_id, route.nodes)
        try:
            self.link.send(
                route.decode, DecodeRequest(request_id, ids, sampling, route.prefill, deadline_s)
            )
            if route.prefill is not None:
                assert route.decode_kv_address is not None, "registry requires kv_address in PD"
                self.link.send(
                    route.prefill,
                    PrefillRequest(
                        request_id, ids, sampling, route.decode, route.decode_kv_address, deadline_s
                    ),
                )
        except BaseException as exc:
            # Whatever failed (a full socket, a message the codec refuses), nothing of the
            # request may stay behind: the queue would never be released.
            self.abort(request_id, route)
            self.events.close(request_id)
            if isinstance(exc, SendError):
                raise OpenAIError(503, str(exc)) from None
            raise
        prompt = prepared.prompt_token_ids  # the list route() hashed: hashing is faster on it
        if route.prefill is not None:
            self.policies["prefill"].sent(route.prefill, prompt)
        self.policies["decode"].sent(route.decode, prompt)
        blocks = -(-len(ids) // route.block_size)
        self.ledger.sent(request_id, route.prefill, len(ids), route.decode, blocks)
        self.admission.admitted(request_id, pd)
        roles = [(n, self.registry.nodes[n].role) for n in route.nodes]
        self.metrics.dispatched(len(ids), roles)
        return queue

    def abort(self, request_id: str, route: Route) -> None:
        """Best effort: a node that cannot be reached is dead or about to be declared so."""
        if self.link is None:
            return
        for node_id in route.nodes:
            try:
                self.link.send(node_id, Abort(request_id))
            except SendError as exc:
                log.warning("abort of %s not delivered: %s", request_id, exc)

    def abort_sample(self, request_id: str, route: Route, index: int) -> None:
        """n > 1: stop one sample on the decode node (the others go on). Best effort."""
        if self.link is None:
            return
        try:
            self.link.send(route.decode, Abort(request_id, index))
        except SendError as exc:
            log.warning("abort of %s sample %d not delivered: %s", request_id, index, exc)

    def release(self, request_id: str) -> None:
        """Forget a request; events that still arrive for it are dropped. Idempotent."""
        if request_id in self.events:
            self.events.close(request_id)
            self.ledger.release(request_id)
            self.admission.release(request_id)
            self.metrics.released()

    def refresh_gauges(self) -> None:
        """Gauges kept by the router itself, brought up to date before a scrape."""
        for pool in ("prefill", "decode"):
            waiting = self.admission.waiting(pool)
            self.metrics.waiting.labels(self.metrics.model_name, pool).set(waiting)

    def _node_snapshot(self) -> list[tuple[str, str, bool, dict[str, Any], dict[str, Any]]]:
        now, timeout = self.liveness_now(), self.registry.timeout
        return [
            (n.node_id, n.role, n.healthy(now, timeout), n.info, n.load)
            for n in list(self.registry.nodes.values())
        ]

    def _choose(self, pool: str, candidates: list[Candidate], prompt: list[int]) -> NodeState:
        node_id = self.policies[pool].choose(candidates, prompt)
        assert node_id is not None, "the policy got a non-empty candidate list"
        return self.registry.nodes[node_id]

    def _decode_candidate(self, node: NodeState) -> Candidate:
        blocks, count = self.ledger.decode_pending(node.node_id)
        return Candidate(
            node.node_id,
            free_blocks=node.load_value("free_blocks") - blocks,
            running=node.load_value("running") + count,
            kv_blocks=_positive_int(node.info.get("num_kv_blocks")),
        )

    def _prefill_candidate(self, node: NodeState) -> Candidate:
        queued = node.load_value("queued_tokens") + self.ledger.prefill_tokens(node.node_id)
        return Candidate(
            node.node_id,
            running=node.load_value("running"),
            queued_tokens=queued,
            kv_blocks=_positive_int(node.info.get("num_kv_blocks")),
        )

    def _lose(self, node_id: str, reason: str) -> None:
        for policy in self.policies.values():
            policy.node_lost(node_id)
        failed = self.events.node_lost(node_id, reason)
        if failed:
            log.error("node %s lost (%s): failing %d requests", node_id, reason, len(failed))


def _no_kv_partners(prefills: list[NodeState], decodes: list[NodeState]) -> OpenAIError:
    """A 503, as for any missing healthy path: the request is valid and the nodes are up, but
    no prefill node's KV pool matches a decode node's (a deployment error, which a node that
    matches may join to fix); the message names the nodes and what differs."""
    pairs = [(p, d, kv_mismatch(p, d)) for d in decodes for p in prefills][:4]
    details = "; ".join(f"prefill node {p.node_id} vs decode node {d.node_id}: {diff}"
                        for p, d, diff in pairs)  # fmt: skip
    return OpenAIError(
        503, f"no healthy prefill node holds KV in the format of a healthy decode node: {details}"
    )


def _positive_int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
