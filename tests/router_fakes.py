"""In-process stand-ins for the nodes, for tests and demos: no sockets, no model.

`LoopbackNodes` is a `NodeLink` that records every message the router sends and answers each
one with the events a script returns, delivered on the next turns of the event loop exactly as
the events socket would deliver them. Messages go through the real wire codec both ways
(`encode` then `decode`), so what the sockets would refuse fails here too. `heartbeat()` builds
a valid Heartbeat.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from common.protocol.messages import (
    DecodeRequest,
    FirstToken,
    Heartbeat,
    PrefillRequest,
    TokenBatch,
    decode,
    encode,
)
from router.node_link import SendError

Script = Callable[[str, Any], list[Any]]  # (node id, message sent to it) -> events to deliver


def heartbeat(
    node_id: str,
    role: str,
    *,
    max_model_len: int = 2048,
    vocab_size: int = 49152,
    block_size: int = 16,
    free_blocks: int = 1000,
    running: int = 0,
    waiting: int = 0,
    queued_tokens: int = 0,
    draining: bool = False,
    **info: Any,
) -> Heartbeat:
    base = {
        "model_name": "loopback",
        "max_model_len": max_model_len,
        "vocab_size": vocab_size,
        "block_size": block_size,
        "num_kv_blocks": free_blocks,
    }
    if role in ("decode", "colocated"):
        base["kv_address"] = f"{node_id}/kv"
    load = {
        "free_blocks": free_blocks,
        "running": running,
        "waiting": waiting,
        "queued_tokens": queued_tokens,
    }
    if draining:
        load["draining"] = True
    return Heartbeat(node_id, role, {**base, **info}, load)


class LoopbackNodes:
    def __init__(self, script: Script | None = None) -> None:
        self.script = script
        self.deliver: Callable[[Any], None] | None = None  # the router's on_message
        self.sent: list[tuple[str, Any]] = []
        self.unreachable: set[str] = set()
        self.connected: list[str] = []  # nodes that registered themselves
        self.disconnected: list[str] = []  # nodes forgotten

    def send(self, node_id: str, message: Any) -> None:
        if node_id in self.unreachable:
            raise SendError(f"node {node_id} is unreachable (loopback)")
        message = decode(encode(message))  # what the node would receive
        self.sent.append((node_id, message))
        if self.script is None or self.deliver is None:
            return
        loop = asyncio.get_running_loop()
        for event in self.script(node_id, message):
            loop.call_soon(self.deliver, decode(encode(event)))

    def connect(self, node_id: str) -> bool:
        self.connected.append(node_id)
        return "://" in node_id  # what zmq would refuse: an address without a transport

    def disconnect(self, node_id: str) -> None:
        self.disconnected.append(node_id)

    def sent_of(self, kind: type) -> list[tuple[str, Any]]:
        return [(node, m) for node, m in self.sent if isinstance(m, kind)]


def generation_script(
    tokens: list[int],
    *,
    finish_reason: str = "stop",
    prefill_timing: dict[str, float] | None = None,
    decode_timing: dict[str, float] | None = None,
    obey_max_tokens: bool = True,
) -> Script:
    """Nodes that answer every request with `tokens`, one per event, the last one finished.

    PD: the prefill node sends the first token as FirstToken and the rest as the decode node's
    TokenBatches (the loopback needs no KV). Colocated: every token is a TokenBatch output and
    the first carries `prefill_timing` too. With `obey_max_tokens` the answer is cut at
    max_tokens and finishes with "length". Logprobs, when asked, are -0.5 per token with the
    token itself as the only top entry.
    """

    def script(node_id: str, message: Any) -> list[Any]:
        pd = isinstance(message, PrefillRequest)
        colocated = isinstance(message, DecodeRequest) and message.prefill_node is None
        if not (pd or colocated):
            return []
        sampling = message.sampling
        answer, reason = list(tokens), finish_reason
        if obey_max_tokens and len(answer) > sampling.max_tokens:
            answer, reason = answer[: sampling.max_tokens], "length"
        wants = sampling.logprobs is not None
        events: list[Any] = []
        for i, token in enumerate(answer):
            last = i == len(answer) - 1
            logprob, top = (-0.5, [[token, -0.5]]) if wants else (None, None)
            done = reason if last else None
            if pd and i == 0:
                timing = dict(prefill_timing or {})
                events.append(
                    FirstToken(message.request_id, token, logprob, top, last, done, 0, timing)
                )
                continue
            timing = None
            if i == (1 if pd else 0):
                timing = {**(decode_timing or {}), **({} if pd else (prefill_timing or {}))}
            events.append(
                TokenBatch(
                    [message.request_id],
                    [token],
                    [done],
                    None if logprob is None else [logprob],
                    None if top is None else [top],
                    {} if timing is None else {message.request_id: timing},
                )
            )
        return events

    return script


class ManualClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample `name` whose labels include `labels`, in a /metrics body."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    return None
