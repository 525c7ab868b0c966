"""One dispatched request, from its first event to its end: the router's half of the lifecycle.

`deltas()` turns node events into client-visible `Delta`s: text released by the incremental
detokenizer, the tokens behind it (with logprobs), and the finish reason. Events that queued up
while the client's previous chunk was being written become one `Delta` per choice, so a busy
router writes fewer, larger chunks instead of falling further behind. The router ends a
request early on a stop string or when `max_tokens` is reached without the node noticing, and
then tells the nodes to abort. A node error, a lost node or the deadline raise `OpenAIError`.
`close()` must run exactly once at the end whatever happened (the HTTP layer guarantees it): it
aborts the request on the nodes unless a node finished it, forgets it, and records metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from common.protocol.messages import FirstToken, PromptLogprobs, RequestError, TokenOutput
from common.text.detokenizer import IncrementalDetokenizer
from router.core import Route, RouterCore
from router.errors import OpenAIError
from router.events import NodeLost, RequestEvent
from router.prepare import PreparedRequest
from router.timing import TimingMarks, TimingRecord, assemble

CLIENT_GONE = 499


class _DeadlinePassed:
    """Put on the request's queue by its deadline timer (one timer per request, not one
    `wait_for` per event: that made a task per token)."""


@dataclass(frozen=True)
class TokenPiece:
    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None  # (token id, logprob), most likely first


@dataclass
class Delta:
    text: str
    pieces: list[TokenPiece] = field(default_factory=list)
    finish_reason: str | None = None
    index: int = 0  # the choice it belongs to
    tool_calls: list[dict[str, Any]] | None = None  # parsed from the text (router.tools)


class _NoText:
    """Stands in for the detokenizer when the model ships no tokenizer: token ids only."""

    stopped_on = None

    def add(self, token_ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


@dataclass
class _Choice:
    """One sample of the request (n > 1 gives several): its text and how it ended."""

    index: int
    detok: IncrementalDetokenizer | _NoText
    tokens: int = 0
    finish_reason: str | None = None
    node_done: bool = False  # the node ended this sample itself
    on_decode: bool = False  # the decode node sent tokens of it, so it can be aborted there
    aborted: bool = False  # the router told the decode node to stop this sample


class Session:
    def __init__(
        self,
        core: RouterCore,
        request_id: str,
        prepared: PreparedRequest,
        route: Route,
        queue: asyncio.Queue[RequestEvent],
        marks: TimingMarks,
        tokenizer: Any,
    ) -> None:
        self.core = core
        self.request_id = request_id
        self.prepared = prepared
        self.route = route
        self.queue = queue
        self.marks = marks
        self.deadline = marks.arrival + core.config.request_timeout_s
        params = prepared.params
        self.choices = [
            _Choice(
                i,
                IncrementalDetokenizer(
                    tokenizer,
                    prepared.prompt_token_ids,
                    params.stop,
                    prepared.skip_special_tokens,
                    params.min_tokens,
                )
                if tokenizer is not None
                else _NoText(),
            )
            for i in range(params.n)
        ]
        self.status: int | None = None  # final status once known (200, an error, or 499)
        # With the first token, when the sampling params asked (the node that prefilled)
        self.prompt_logprobs: PromptLogprobs | None = None
        self._first_seen = route.prefill is None  # PD: decode outputs wait for the FirstToken
        self._decoding = False  # the first token and a decode output were both handled
        self._early: list[TokenOutput] = []
        self._nodes_done = False  # the nodes are done with the request: nothing to abort
        self._closed = False
        self._deadline_timer: asyncio.TimerHandle | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    async def deltas(self) -> AsyncIterator[Delta]:
        if self._deadline_timer is None and not self._closed:
            remaining = max(0.0, self.deadline - self.core.clock())
            expire = self.queue.put_nowait
            loop = asyncio.get_running_loop()
            self._deadline_timer = loop.call_later(remaining, expire, _DeadlinePassed())
        while not self.finished:
            ready: dict[int, Delta] = {}
            try:
                event = await self.queue.get()
                while True:
                    for delta in self._handle(event):
                        merge_delta(ready, delta)
                    if self.finished or self.queue.empty():
                        break
                    event = self.queue.get_nowait()
            except OpenAIError as exc:
                self.status = exc.status
                for delta in ready.values():  # what the client may still see before the error
                    yield delta
                raise
            for delta in ready.values():
                yield delta

    def usage(self) -> dict[str, int]:
        prompt = len(self.prepared.prompt_token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
        }

    def timing(self) -> TimingRecord:
        return assemble(self.marks, self.core.clock())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        if self.status is None:
            self.status = CLIENT_GONE
        if not self._nodes_done:
            self.core.abort(self.request_id, self.route)
        self.core.release(self.request_id)
        self.core.metrics.request_done(
            self.status,
            self.timing(),
            self.completion_tokens,
            [c.finish_reason for c in self.choices if c.finish_reason is not None],
        )

    def _handle(self, event: RequestEvent | _DeadlinePassed) -> list[Delta]:
        if isinstance(event, _DeadlinePassed):
            timeout = self.core.config.request_timeout_s
            raise OpenAIError(504, f"the request did not finish within {timeout} s")
        if isinstance(event, NodeLost):
            if event.node_id == self.route.prefill and self._decoding:
                return []  # queued before the decode node's takeover was read: harmless
            raise OpenAIError(503, f"node {event.node_id} failed: {event.reason}")
        if isinstance(event, RequestError):
            status = event.status if 400 <= event.status <= 599 else 500
            raise OpenAIError(status, event.message)
        outputs: list[tuple[int, list[TokenPiece], bool, str | None]] = []
        self.marks.merge_node_timing(event.timing)
        if isinstance(event, FirstToken):
            self.core.admission.first_token(self.request_id)
            self._first_seen = True
            if event.prompt_logprobs is not None:
                self.prompt_logprobs = event.prompt_logprobs
            first = TokenPiece(event.token_id, event.logprob, _pairs(event.top_logprobs))
            outputs.append((0, [first], event.finished, event.finish_reason))
            early, self._early = self._early, []
            if early:
                self._decode_took_over()
        else:
            if not self._decoding:
                self.core.admission.decoding(self.request_id)
            if not self._first_seen:
                self._early.append(event)  # overtook the prefill node's first token
                return []
            self._decode_took_over()
            early = [event]
        for output in early:
            if output.prompt_logprobs is not None:
                self.prompt_logprobs = output.prompt_logprobs
            if 0 <= output.index < len(self.choices):
                choice = self.choices[output.index]
                choice.on_decode = True
                if choice.finish_reason is not None and not (choice.node_done or output.finished):
                    # Ended by the router before the decode node had it (the first token hit
                    # a stop string or max_tokens): the node runs it on until told.
                    self._abort_sample(choice)
                outputs.append(
                    (output.index, _pieces(output), output.finished, output.finish_reason)
                )
                if output.spec_decode is not None:
                    self.marks.add_spec_decode(output.spec_decode)
        arrived = dict.fromkeys(index for index, pieces, _, _ in outputs if pieces)
        if arrived:
            now = self.core.clock()
            for index in arrived:  # one arrival per choice, however many outputs it had here
                self.marks.tokens_arrived(now, index)
        deltas: dict[int, Delta] = {}
        for index, pieces, finished, reason in outputs:
            choice = self.choices[index]
            text, accepted = self._accept(choice, pieces, finished, reason)
            delta = deltas.setdefault(index, Delta("", index=index))
            delta.text += text
            delta.pieces += accepted
            delta.finish_reason = choice.finish_reason
        return [d for d in deltas.values() if d.text or d.pieces or d.finish_reason]

    def _decode_took_over(self) -> None:
        """The first token and a decode output are both in: the decode node runs on its own
        now and losing the prefill node is harmless. (Before the first token it is not: the
        prefill node sends that token.)"""
        if self._decoding:
            return
        self._decoding = True
        if self.route.prefill is not None:
            self.core.events.forget_node(self.request_id, self.route.prefill)

    def _accept(
        self,
        choice: _Choice,
        pieces: list[TokenPiece],
        node_finished: bool,
        node_reason: str | None,
    ) -> tuple[str, list[TokenPiece]]:
        """Take tokens until the sample ends; returns the released text and the tokens kept."""
        max_tokens = self.prepared.params.max_tokens
        texts: list[str] = []
        accepted: list[TokenPiece] = []
        for i, piece in enumerate(pieces):
            if choice.finish_reason is not None:
                break
            node_done = node_finished and i == len(pieces) - 1
            if not self.prepared.generates:  # max_tokens 0: the node's token is not shown
                self._finish(choice, "length", node_done)
                break
            accepted.append(piece)
            choice.tokens += 1
            texts.append(choice.detok.add([piece.token_id]))
            if choice.detok.stopped_on is not None:
                self._finish(choice, "stop", node_done)
            elif max_tokens is not None and choice.tokens >= max_tokens:
                self._finish(
                    choice, (node_reason or "length") if node_done else "length", node_done
                )
        if choice.finish_reason is None and node_finished:
            if node_reason in ("error", "abort"):
                status = 500 if node_reason == "error" else 503
                raise OpenAIError(status, f"the node ended the request: {node_reason}")
            self._finish(choice, node_reason or "stop", True)
        if choice.finish_reason is not None and choice.detok.stopped_on is None:
            texts.append(choice.detok.flush())
        return "".join(texts), accepted

    def _finish(self, choice: _Choice, reason: str, node_done: bool) -> None:
        choice.finish_reason = reason
        choice.node_done = node_done
        if not self.finished:
            if not node_done and choice.on_decode:
                self._abort_sample(choice)
            return
        self.status = 200
        self.marks.finished = self.core.clock()
        if not all(c.node_done for c in self.choices):
            self.core.abort(self.request_id, self.route)
        self._nodes_done = True  # finished by the nodes, or aborted now: close() need not

    def _abort_sample(self, choice: _Choice) -> None:
        """Only this sample is over: the decode node stops it, the others go on. Once, and
        never once the whole request ended (then the request is aborted, or done)."""
        if not choice.aborted and not self.finished:
            choice.aborted = True
            self.core.abort_sample(self.request_id, self.route, choice.index)


def merge_delta(ready: dict[int, Delta], delta: Delta) -> None:
    """Add `delta` to the one already collected for its choice (kept in arrival order)."""
    into = ready.get(delta.index)
    if into is None:
        ready[delta.index] = delta
        return
    into.text += delta.text
    into.pieces += delta.pieces
    into.tool_calls = (into.tool_calls or []) + (delta.tool_calls or []) or None
    into.finish_reason = delta.finish_reason or into.finish_reason


def _pairs(raw: list[list[float]] | None) -> tuple[tuple[int, float], ...] | None:
    if raw is None:
        return None
    return tuple((int(p[0]), float(p[1])) for p in raw if len(p) >= 2)


def _pieces(output: TokenOutput) -> list[TokenPiece]:
    logprobs, tops = output.logprobs, output.top_logprobs
    return [
        TokenPiece(
            token,
            logprobs[i] if logprobs is not None and i < len(logprobs) else None,
            _pairs(tops[i]) if tops is not None and i < len(tops) else None,
        )
        for i, token in enumerate(output.token_ids)
    ]
