"""The decode node's event loop: reserve, receive KV, admit, decode, stream tokens."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field

from common.engine.config import EngineConfig
from common.engine.core import EngineCore
from common.engine.scheduler import SampledToken, ScheduledBatch, Scheduler
from common.engine.sequence import Sequence, SequenceStatus
from common.engine.tp_ranks import RankRole
from common.engine.worker import Worker
from common.node.channel import HOST_ID, NodeChannel, runtime_info
from common.node.config import NodeConfig
from common.node.lifecycle import Lifecycle
from common.protocol.messages import Abort, DecodeRequest, RequestError, Reservation, TokenBatch
from common.protocol.sampling_params import SamplingParams
from decode_node.choices import ChoiceGroups
from decode_node.reservations import PendingDecode, ReservationQueue
from kv_transfer import Transfer, TransferConfig, TransferState, create_receiver
from kv_transfer.tp import TPPoolWriter, check_transport, decode_rank_handler

log = logging.getLogger(__name__)

EXPIRY_INTERVAL_S = 0.1  # how often requests are checked against their deadlines


@dataclass
class DecodeTiming:
    """Decode-side moments of one request (this process's monotonic clock)."""

    arrived_at: float = field(default_factory=time.monotonic)
    reserved_at: float | None = None
    kv_landed_at: float | None = None
    kv_first_frame_at: float | None = None
    first_step_at: float | None = None
    prefill_timing: dict[str, float] = field(default_factory=dict)
    prefill_first_token_at: float | None = None  # prefill node's clock; set only on one host
    sent_first: bool = False
    decode_s: float = 0.0  # parsing the DecodeRequest
    deadline: float | None = None  # past it the node drops the request (see _expire)

    def first_report(self) -> dict[str, float]:
        out = dict(self.prefill_timing)
        if self.reserved_at is not None:
            out["decode_reservation_wait"] = self.reserved_at - self.arrived_at
        if self.kv_landed_at is not None and self.reserved_at is not None:
            start = self.kv_first_frame_at or self.reserved_at
            out["kv_transfer"] = self.kv_landed_at - start
            out["kv_wait_after_reservation"] = self.kv_landed_at - self.reserved_at
        if self.kv_landed_at is not None and self.prefill_first_token_at is not None:
            # The part of the transfer not hidden behind prefill compute (same host only).
            out["kv_transfer_exposed"] = max(0.0, self.kv_landed_at - self.prefill_first_token_at)
        if self.kv_landed_at is not None and self.first_step_at is not None:
            out["decode_admission_wait"] = self.first_step_at - self.kv_landed_at
        return out


class DecodeNode:
    def __init__(
        self, node_config: NodeConfig, engine_config: EngineConfig, worker: Worker | None = None
    ) -> None:
        """`worker`: one already built from `engine_config` (benchmarks reuse a loaded model)."""
        self.config = node_config
        self.colocated = node_config.colocated
        if not self.colocated:
            check_transport(node_config.transport, engine_config.tp)
        role = None if self.colocated else RankRole(decode_rank_handler)
        self.worker = worker or Worker(engine_config, role)
        self.scheduler = Scheduler(engine_config.scheduler, self.worker.allocator)
        self.core = EngineCore(
            self.worker, self.scheduler, overlap=engine_config.overlap_scheduling
        )
        self.reservations = ReservationQueue(self.worker.allocator)
        self.choices = ChoiceGroups(self.scheduler)  # n > 1: samples forked on the prompt
        self.receiver = None
        extra = {}
        if not self.colocated:
            self.receiver = create_receiver(
                TransferConfig(
                    transport=node_config.transport, deadline_s=node_config.transfer_deadline_s
                ),
                self.worker.kv_cache.pool,
                node_config.kv_address,
            )
            if self.worker.runner.link is not None:  # rank 0 hands the ranks their heads
                layout = self.worker.tp.layout(self.worker.spec)
                writer = TPPoolWriter(self.worker.kv_cache.pool, layout, self.worker.runner.link)
                self.receiver.set_writer(writer)
            extra["kv_address"] = self.receiver.address
        role = "colocated" if self.colocated else "decode"
        self.channel = NodeChannel(node_config.control_address, node_config.router_address, role)
        self.info = runtime_info(self.worker.runtime, **extra)
        self.timings: dict[str, DecodeTiming] = {}
        self.quarantined: dict[str, PendingDecode] = {}  # aborted, blocks not yet safe to reuse
        self.lifecycle = Lifecycle(node_config.drain_timeout_s)
        self._last_expiry = 0.0
        # Counters since start, reported in the heartbeat load (the router's /metrics).
        self.stats: Counter[str] = Counter()
        num_blocks = self.worker.allocator.num_blocks
        self._headroom_blocks = math.ceil(node_config.kv_growth_headroom * num_blocks)
        pool = self.worker.kv_cache.pool
        # all layers, K and V, every KV head (a tensor-parallel rank's pool holds some)
        self._block_bytes = self.worker.spec.kv_bytes_per_token(pool.element_size()) * pool.shape[3]

    # -- loop -------------------------------------------------------------------------------
    def run(self) -> None:
        self.lifecycle.install_signal_handlers()
        log.info("%s node %s ready", self.channel.role, self.channel.node_id)
        self.channel.start_heartbeat(self.info, self._load())
        try:
            while not self.lifecycle.should_exit(idle=not self.timings and not self.quarantined):
                self.step()
        finally:
            if self.receiver is not None:
                self.receiver.close()
            self.channel.close()
            self.worker.close()  # stops its tensor-parallel ranks

    def stop(self) -> None:
        self.lifecycle.stop()

    def step(self) -> None:
        inbox_wait, kv_wait = self._waits()
        for message, decode_s in self.channel.receive_timed(timeout_s=inbox_wait):
            self.handle(message, decode_s)
        if self.receiver is not None:
            self._reserve_blocks()
            for transfer in self.receiver.poll(timeout_s=kv_wait):
                self._transfer_ended(transfer)
        if self.core.has_work():
            self._decode_step()
        self._expire()
        self.channel.publish_load(self._load)

    def _waits(self) -> tuple[float, float]:
        """(inbox wait, KV receiver wait) of the next step: no wait while there are steps to run.
        Idle, or stalled (the engine's head prompt waits for blocks, which reservations and
        quarantined transfers may hold), the wait goes to the socket that matters next: the KV
        receiver while transfers are in flight (their completion is on the path to the second
        token), else the inbox."""
        if self.core.has_work() and not self.core.stalled:
            return 0.0, 0.0
        if self.reservations.reserved or self.quarantined:
            return 0.0, 0.001
        return 0.005, 0.0

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
    def _accept(self, request: DecodeRequest, decode_s: float = 0.0) -> None:
        rid = request.request_id
        if rid in self.timings or rid in self.quarantined:  # quarantined: its transfer lingers
            self.channel.to_router(RequestError(rid, f"duplicate request id {rid!r}", 400))
            return
        try:
            seq = self._new_sequence(rid, request.prompt_token_ids, request.sampling)
        except (TypeError, ValueError) as exc:
            self.channel.to_router(RequestError(rid, str(exc), 400))
            return
        if request.prefill_node is None:
            if not self.colocated:
                self.channel.to_router(
                    RequestError(rid, "this decode node needs a prefill node", 400)
                )
                return
            self.scheduler.add(seq)
        elif self.colocated:
            self.channel.to_router(RequestError(rid, "a colocated node takes no prefill node", 400))
            return
        else:
            self.reservations.add(request)
        timing = self.timings[rid] = DecodeTiming(decode_s=decode_s)
        if request.deadline_s is not None:
            timing.deadline = timing.arrived_at + request.deadline_s

    def _new_sequence(self, rid: str, prompt: list[int], params: SamplingParams) -> Sequence:
        seq = self.worker.new_sequence(rid, prompt, params)
        if self.scheduler.blocks_for(len(prompt) + 1) > self.worker.allocator.num_blocks:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit this node's KV pool")
        return seq

    def _reserve_blocks(self) -> None:
        while (keep_free := self._growth_headroom()) is not None:
            pending = self.reservations.reserve_next(keep_free)
            if pending is None:
                return
            rid = pending.request.request_id
            self.receiver.expect(rid, pending.block_ids)
            self.timings[rid].reserved_at = pending.reserved_at
            prefill_node = pending.request.prefill_node
            reservation = Reservation(rid, self.channel.node_id, pending.block_ids)
            if not self.channel.to_peer(prefill_node, reservation):
                self.receiver.withdraw(rid)  # no sender knows the blocks: free them now
                self.reservations.release(rid)
                self._end(rid)
                message = f"cannot reach prefill node {prefill_node!r}"
                self.channel.to_router(RequestError(rid, message, 503))

    def _growth_headroom(self) -> int | None:
        """Blocks a new reservation must leave available, or None: reserve nothing now.

        Out of KV memory the decode node preempts and recomputes (Scheduler._grow: the latest
        running sequence frees its blocks and is prefilled again here, usually from the prefix
        cache), and it never deadlocks: reservations hold blocks only until their KV lands or
        their transfer deadline passes, preempted sequences wait for nothing but blocks, and
        new reservations wait while any preempted sequence does. The headroom keeps that rare:
        running sequences keep room to grow, except on an empty node, which takes any prompt
        that fits (the router never sends one that does not)."""
        if self.scheduler.waiting:
            return None
        if not (self.scheduler.running or self.scheduler.ready or self.reservations.reserved):
            return 0
        return self._headroom_blocks

    def _transfer_ended(self, transfer: Transfer) -> None:
        rid = transfer.request_id
        held = self.quarantined.pop(rid, None)
        if held is not None:  # aborted earlier; now nothing writes into its blocks any more
            self.worker.allocator.free(held.block_ids)
            return
        pending = self.reservations.take(rid)
        timing = self.timings.get(rid)
        if pending is None or timing is None:
            return
        if transfer.state is TransferState.FAILED:
            self.worker.allocator.free(pending.block_ids)
            self._end(rid)
            if transfer.answered_by_sender:
                # The prefill node ended the request (its first token finished it, the router
                # aborted it, or it failed and said so): the router heard it from there, and an
                # error from here could overtake that first token on the router's socket.
                self.stats["kv_transfers_ended_by_sender"] += 1
                return
            self.stats["kv_transfer_failures"] += 1
            self.channel.to_router(RequestError(rid, f"KV transfer failed: {transfer.error}", 500))
            return
        meta = transfer.metadata or {}
        timing.kv_landed_at = transfer.finished_at or time.monotonic()
        timing.kv_first_frame_at = transfer.in_flight_at
        self.stats["kv_transfer_bytes"] += len(pending.block_ids) * self._block_bytes
        start = transfer.in_flight_at or pending.reserved_at or timing.kv_landed_at
        self.stats["kv_transfer_seconds"] += timing.kv_landed_at - start
        timing.prefill_timing = {k: float(v) for k, v in (meta.get("timing") or {}).items()}
        if meta.get("host_id") == HOST_ID and isinstance(meta.get("first_token_at"), float):
            timing.prefill_first_token_at = meta["first_token_at"]
        req = pending.request
        seq = self._new_sequence(rid, req.prompt_token_ids, req.sampling)
        seq.block_ids = pending.block_ids
        seq.num_computed_tokens = len(req.prompt_token_ids)
        ended = seq.append_token(int(meta["first_token"]))
        self.scheduler.add_running(seq)
        self.choices.fork(seq)  # n > 1: the other samples share the prompt's blocks
        if ended is not None:
            # n > 1 whose first sample ended at the prefill node's token (the router knows):
            # it only lent its blocks to the others.
            self._abort_sample(rid, 0)

    # -- decoding ---------------------------------------------------------------------------
    def _decode_step(self) -> None:
        for out in self.core.step(before_launch=self._mark_first_step):
            if out.error is not None:
                for rid in dict.fromkeys(item.seq.group for item in out.batch.items):
                    self._abort(rid)
                    self.channel.to_router(RequestError(rid, f"decode failed: {out.error}", 500))
                continue
            rows = out.new_tokens()
            if rows:
                self.channel.to_router(self._token_batch(rows))

    def _mark_first_step(self, batch: ScheduledBatch) -> None:
        now = time.monotonic()
        for item in batch.items:
            timing = self.timings.get(item.seq.group)
            if timing is not None and timing.first_step_at is None:
                timing.first_step_at = now
            if item.samples and not item.seq.output_token_ids:
                # Colocated: this step completes the prompt; the other samples of an n > 1
                # request share its blocks and run from the next step.
                self.choices.fork(item.seq)

    def _token_batch(self, rows: list[tuple[Sequence, SampledToken]]) -> TokenBatch:
        """One step's outputs, column-wise; the first output of a request carries its timing."""
        ids, tokens, reasons, indices, timing = [], [], [], [], {}
        logprobs: list[float | None] | None = None
        tops: list | None = None
        for i, (seq, token) in enumerate(rows):
            rid = seq.group
            ids.append(rid)
            indices.append(seq.index)
            tokens.append(token.token_id)
            report = self._first_report(rid)
            if report is not None:
                timing[rid] = report
                if self.colocated:  # the prompt was looked up in this node's prefix cache
                    self.stats["prefix_cache_queries"] += len(seq.prompt_token_ids)
                    self.stats["prefix_cache_hits"] += seq.num_cached_tokens
            finished = seq.status is SequenceStatus.FINISHED
            reasons.append(seq.finish_reason.value if finished and seq.finish_reason else None)
            if finished:  # this sample; the request ends with its last sample
                self.core.release(seq.request_id)
                if self.choices.ended(seq):
                    self._end(rid)
            if token.logprob is not None:
                logprobs = logprobs or [None] * len(rows)
                logprobs[i] = token.logprob
            if token.top_logprobs is not None:
                tops = tops or [None] * len(rows)
                tops[i] = [[t, lp] for t, lp in token.top_logprobs]
        sampled_index = any(indices)
        return TokenBatch(
            ids, tokens, reasons, logprobs, tops, timing, indices if sampled_index else None
        )

    def _first_report(self, rid: str) -> dict[str, float] | None:
        timing = self.timings.get(rid)
        if timing is None or timing.sent_first:
            return None
        timing.sent_first = True
        report = timing.first_report()
        if self.colocated:  # the TTFT phases are this node's
            report["node_decode"] = timing.decode_s
            start = timing.first_step_at or timing.arrived_at
            report["prefill_queue"] = start - timing.arrived_at
            report["prefill_compute"] = time.monotonic() - start
        return report

    # -- endings ----------------------------------------------------------------------------
    def _expire(self) -> None:
        """Drop requests past their deadline: the router gave up on them (its abort may be
        lost, or the router gone), and whatever they hold is freed here."""
        now = time.monotonic()
        if now - self._last_expiry < EXPIRY_INTERVAL_S:
            return
        self._last_expiry = now
        late = [r for r, t in self.timings.items() if t.deadline is not None and now > t.deadline]
        for rid in late:
            self.stats["expired_requests"] += 1
            self._abort(rid)
            self.channel.to_router(RequestError(rid, "the request passed its deadline", 504))

    def _abort(self, request_id: str) -> None:
        pending = self.reservations.reserved.get(request_id)
        if pending is not None and not self.receiver.cancel(request_id):
            # A sender may still write into these blocks (cuda_ipc): keep them out of the
            # pool until the receiver reports the transfer over (see KVReceiver.cancel).
            self.quarantined[request_id] = self.reservations.take(request_id)
        else:
            self.reservations.release(request_id)
        for seq_id in self.choices.sequence_ids(request_id):
            self.core.abort(seq_id)  # frees the blocks of a running/waiting sequence
        self._end(request_id)

    def _abort_sample(self, request_id: str, index: int) -> None:
        """End one sample of an n > 1 request (the router is done with it); no-op if gone."""
        seq = self.core.abort(request_id if index == 0 else f"{request_id}#{index}")
        if seq is not None and self.choices.ended(seq):
            self._end(request_id)

    def _end(self, request_id: str) -> None:
        self.timings.pop(request_id, None)
        self.choices.forget(request_id)
        self.core.release(request_id)

    def _load(self) -> dict[str, int | float]:
        allocator = self.worker.allocator
        stats = allocator.stats()
        return {
            "free_blocks": stats.num_free + stats.num_cached,
            "prefix_queried_blocks": allocator.prefix_queried_blocks,
            "prefix_hit_blocks": allocator.prefix_hit_blocks,
            "used_blocks": stats.num_used,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting)
            + len(self.scheduler.ready)
            + len(self.reservations.waiting),
            "reserved": len(self.reservations.reserved),
            "quarantined": len(self.quarantined),
            "queued_tokens": sum(s.num_pending_tokens for s in self.scheduler.waiting),
            "invalid_messages": self.channel.invalid_messages,
            "undelivered_messages": self.channel.undelivered_messages,
            "preemptions": self.scheduler.num_preemptions,
            "kv_late_frames": self.receiver.late_frames if self.receiver else 0,
            "kv_malformed_frames": self.receiver.malformed_frames if self.receiver else 0,
            "draining": self.lifecycle.draining,
            **self.stats,
        }
