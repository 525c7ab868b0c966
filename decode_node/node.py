"""The decode node: one record per request, an admission part per mode, continuous-batch
decode, tokens streamed to the router. The loop itself is `common.node.loop.NodeLoop`."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from common.engine.config import EngineConfig
from common.engine.core import EngineCore
from common.engine.scheduler import SampledToken, ScheduledBatch
from common.engine.sequence import Sequence
from common.engine.spec_decode.factory import build_proposer, decoding_scheduler
from common.engine.worker import Worker
from common.node.channel import NodeChannel, runtime_info
from common.node.config import NodeConfig
from common.node.loop import NodeLoop
from common.protocol.messages import Abort, DecodeRequest, RequestError, TokenBatch
from decode_node import choices
from decode_node.admission import ADMISSIONS, Dropped, Landed
from decode_node.request import DecodeTiming, Phase, Request

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005  # inbox wait of an idle loop
TRANSFER_WAIT_S = 0.001  # KV receiver wait of a loop with nothing to run but transfers in flight


class DecodeNode:
    def __init__(
        self, node_config: NodeConfig, engine_config: EngineConfig, worker: Worker | None = None
    ) -> None:
        """`worker`: one already built from `engine_config` (benchmarks reuse a loaded model)."""
        self.config = node_config
        admission_cls = ADMISSIONS[node_config.colocated]
        rank_role = admission_cls.rank_role(node_config, engine_config)
        self.worker = worker or Worker(engine_config, rank_role)
        self.scheduler = decoding_scheduler(engine_config, self.worker.allocator)
        self.core = EngineCore(
            self.worker,
            self.scheduler,
            overlap=engine_config.overlap_scheduling,
            proposer=build_proposer(engine_config, self.worker),
        )
        self.channel = NodeChannel(
            node_config.control_address, node_config.router_address, admission_cls.role
        )
        # Counters since start, reported in the heartbeat load (the router's /metrics).
        self.stats: Counter[str] = Counter()
        self.admission = admission_cls(
            node_config, self.worker, self.scheduler, self.channel, self.stats
        )
        self.info = runtime_info(self.worker.runtime, **self.admission.info)
        self.requests: dict[str, Request] = {}  # every request this node holds, by id
        self.loop = NodeLoop(self, self.channel, node_config.drain_timeout_s)

    # -- the NodeLoop's role ----------------------------------------------------------------
    def run(self) -> None:
        self.loop.run(self.info)

    def stop(self) -> None:
        self.loop.stop()

    def step(self) -> None:
        self.loop.step()

    def idle(self) -> bool:
        return not self.requests

    def has_work(self) -> bool:
        return self.core.has_work()

    def close(self) -> None:
        self.admission.close()
        self.worker.close()  # stops its tensor-parallel ranks

    def _ready(self) -> bool:
        return self.core.has_work() and not self.core.stalled

    def inbox_wait(self) -> float:
        """No wait while there are steps to run. Idle, or stalled (the engine's head prompt
        waits for blocks, which reservations and quarantined transfers may hold), the wait goes
        to the socket that matters next: the KV receiver while transfers are in flight (their
        completion is on the path to the second token), else the inbox."""
        if self._ready() or self.admission.busy():
            return 0.0
        return IDLE_WAIT_S

    def poll_transport(self) -> None:
        wait_s = 0.0 if self._ready() else TRANSFER_WAIT_S
        for outcome in self.admission.poll(self.requests.get, wait_s):
            if isinstance(outcome, Landed):
                req = outcome.request
                choices.fork(self.scheduler, req, req.seq)  # n > 1: share the prompt's blocks
                if outcome.first_finished:
                    self._abort_sample(req.id, 0)
            else:
                self._dropped(outcome)

    def _dropped(self, outcome: Dropped) -> None:
        self._end(outcome.request)
        if outcome.error is not None:
            self.channel.to_router(outcome.error)

    def handle(self, message: object, decode_s: float = 0.0) -> None:
        """`decode_s`: how long parsing the message took (colocated: reported as node_decode)."""
        if isinstance(message, DecodeRequest):
            self._accept(message, decode_s)
        elif isinstance(message, Abort):
            if message.index is None:
                self._abort(message.request_id)
            else:
                self._abort_sample(message.request_id, message.index)
        else:
            log.warning("decode node ignores %s", type(message).__name__)

    # -- admission --------------------------------------------------------------------------
    def _accept(self, message: DecodeRequest, decode_s: float = 0.0) -> None:
        rid = message.request_id
        if rid in self.requests:  # a quarantined one included: its transfer lingers
            self.channel.to_router(RequestError(rid, f"duplicate request id {rid!r}", 400))
            return
        try:
            seq = self._new_sequence(rid, message)
        except (TypeError, ValueError) as exc:
            self.channel.to_router(RequestError(rid, str(exc), 400))
            return
        refusal = self.admission.refuse(message)
        if refusal is not None:
            self.channel.to_router(RequestError(rid, refusal, 400))
            return
        req = self.requests[rid] = Request(message, seq, DecodeTiming(decode_s=decode_s))
        if message.deadline_s is not None:
            req.deadline = req.timing.arrived_at + message.deadline_s
        self.admission.accept(req)

    def _new_sequence(self, rid: str, message: DecodeRequest) -> Sequence:
        prompt = message.prompt_token_ids
        seq = self.worker.new_sequence(rid, prompt, message.sampling)
        if self.scheduler.blocks_for(len(prompt) + 1) > self.worker.allocator.num_blocks:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit this node's KV pool")
        return seq

    # -- decoding ---------------------------------------------------------------------------
    def engine_step(self) -> None:
        for out in self.core.step(before_launch=self._mark_first_step):
            if out.error is not None:
                for rid in dict.fromkeys(item.seq.group for item in out.batch.items):
                    self._abort(rid)
                    self.channel.to_router(RequestError(rid, f"decode failed: {out.error}", 500))
                continue
            rows = out.new_tokens()
            if rows:
                ended = {seq.request_id for seq in out.finished}
                self.channel.to_router(self._token_batch(rows, ended))

    def _mark_first_step(self, batch: ScheduledBatch) -> None:
        now = time.monotonic()
        for item in batch.items:
            req = self.requests.get(item.seq.group)
            if req is None:
                continue
            if req.timing.first_step_at is None:
                req.timing.first_step_at = now
            if item.samples and not item.seq.output_token_ids:
                # Colocated: this step completes the prompt; the other samples of an n > 1
                # request share its blocks and run from the next step.
                choices.fork(self.scheduler, req, item.seq)

    def _token_batch(
        self, rows: list[tuple[Sequence, SampledToken]], ended: set[str]
    ) -> TokenBatch:
        """One step's outputs, column-wise; the first output of a request carries its timing,
        a speculating sample's last output its speculative decoding counts. `ended`: the
        samples that finished at this step (one `EngineCore.step` may return two steps' outputs,
        and by then a sample may have finished at the later one)."""
        ids, tokens, reasons, indices, timing, prompt = [], [], [], [], {}, {}
        logprobs: list[float | None] | None = None
        tops: list | None = None
        specs: list[dict[str, Any] | None] | None = None
        speculating = self.worker.config.speculative.enabled
        # A verify step emits several rows of one sample: only its last can finish it.
        last_row = {seq.request_id: i for i, (seq, _) in enumerate(rows)}
        for i, (seq, token) in enumerate(rows):
            rid = seq.group
            req = self.requests.get(rid)
            ids.append(rid)
            indices.append(seq.index)
            tokens.append(token.token_id)
            if req is not None and not req.timing.sent_first:
                timing[rid] = self._first_report(req)
                if (prompt_logprobs := self.admission.prompt_logprobs(req)) is not None:
                    prompt[rid] = prompt_logprobs
            finished = seq.request_id in ended and last_row[seq.request_id] == i
            reasons.append(seq.finish_reason.value if finished and seq.finish_reason else None)
            if finished and speculating:
                specs = specs or [None] * len(rows)
                specs[i] = {
                    **seq.spec.to_dict(),
                    "accepted_per_position": list(seq.spec.accepted_per_position),
                }
            if finished:  # this sample; the request ends with its last sample
                self.core.release(seq.request_id)
                if req is not None and choices.sample_ended(req, seq):
                    self._end(req)
            if token.logprob is not None:
                logprobs = logprobs or [None] * len(rows)
                logprobs[i] = token.logprob
            if token.top_logprobs is not None:
                tops = tops or [None] * len(rows)
                tops[i] = [[t, lp] for t, lp in token.top_logprobs]
        indices_column = indices if any(indices) else None
        return TokenBatch(
            ids, tokens, reasons, logprobs, tops, timing, indices_column, specs, prompt
        )

    def _first_report(self, req: Request) -> dict[str, float]:
        req.timing.sent_first = True
        return {**req.timing.first_report(), **self.admission.first_report(req)}

    # -- endings ----------------------------------------------------------------------------
    def expire(self, now: float) -> None:
        """Drop requests past their deadline: the router gave up on them (its abort may be
        lost, or the router gone), and whatever they hold is freed here."""
        late = [
            r
            for r in self.requests.values()
            if r.deadline is not None and now > r.deadline and r.phase is not Phase.QUARANTINED
        ]
        for req in late:
            self.stats["expired_requests"] += 1
            self._end(req)
            self.channel.to_router(RequestError(req.id, "the request passed its deadline", 504))

    def _abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            self._end(req)

    def _abort_sample(self, request_id: str, index: int) -> None:
        """End one sample of an n > 1 request (the router is done with it); no-op if gone."""
        req = self.requests.get(request_id)
        if req is None:
            return
        seq = self.core.abort(request_id if index == 0 else f"{request_id}#{index}")
        if seq is not None and choices.sample_ended(req, seq):
            self._end(req)

    def _end(self, req: Request) -> None:
        """The one place a request ends: whatever it holds goes back. A reservation a sender
        may still write stays QUARANTINED (its record, and so its id, kept) until the KV
        receiver reports the transfer over; the admission then drops it, which lands here."""
        if not self.admission.release(req):
            return
        if req.block_ids:  # reserved, never handed to a sequence
            self.worker.allocator.free(req.block_ids)
            req.block_ids = []
        for seq_id in sorted(req.samples):  # the request id sorts first
            self.core.abort(seq_id)  # frees the blocks of a running/waiting sequence
        req.samples.clear()
        self.core.release(req.id)
        del self.requests[req.id]

    def load(self) -> dict[str, int | float]:
        allocator = self.worker.allocator
        stats = allocator.stats()
        scheduler = self.scheduler
        return {
            "free_blocks": stats.num_free + stats.num_cached,
            "prefix_queried_blocks": allocator.prefix_queried_blocks,
            "prefix_hit_blocks": allocator.prefix_hit_blocks,
            "used_blocks": stats.num_used,
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting) + len(scheduler.ready) + self.admission.num_queued,
            "queued_tokens": sum(s.num_pending_tokens for s in scheduler.waiting),
            "invalid_messages": self.channel.invalid_messages,
            "undelivered_messages": self.channel.undelivered_messages,
            "preemptions": scheduler.num_preemptions,
            **self.admission.load(),
            **self.stats,
        }
