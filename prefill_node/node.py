"""The prefill node's event loop: receive, schedule, run, send the first token, ship KV."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from functools import partial

from common.engine.config import EngineConfig
from common.engine.core import EngineCore, LayerHook
from common.engine.scheduler import ScheduledBatch, Scheduler
from common.engine.sequence import Sequence
from common.engine.spec_decode.aux_rows import AUX_ROWS_KEY, PromptAuxRows
from common.engine.tp_ranks import RankRole
from common.engine.worker import Worker
from common.node.channel import HOST_ID, NodeChannel, runtime_info
from common.node.config import NodeConfig
from common.node.loop import NodeLoop
from common.protocol.messages import (
    Abort,
    PrefillRequest,
    RequestError,
    Reservation,
)
from kv_transfer import TransferConfig, TransferState, create_sender
from kv_transfer.tp import TPSender, check_transport, prefill_rank_handler, rank_transfer
from prefill_node.jobs import EndedRequests, PrefillJob, check_reserved, first_token

log = logging.getLogger(__name__)

ENDED_BEFORE_TRANSFER = "the request ended on the prefill node before its transfer began"
IDLE_WAIT_S = 0.01  # inbox wait of an idle loop
TRANSFER_WAIT_S = 0.001  # ... of a loop with nothing to compute but transfers in flight


class PrefillNode:
    def __init__(self, node_config: NodeConfig, engine_config: EngineConfig) -> None:
        self.config = node_config
        transfer = TransferConfig(
            transport=node_config.transport,
            deadline_s=node_config.transfer_deadline_s,
            fail_rate=node_config.fail_transfer_rate,
        )
        check_transport(node_config.transport, engine_config.tp, engine_config.pp)
        self.worker = Worker(
            engine_config, RankRole(partial(prefill_rank_handler, transfer)), drafts=False
        )
        self.scheduler = Scheduler(
            engine_config.scheduler, self.worker.allocator, prefill_only=True
        )
        # Synchronous: the first token leaves as soon as it is sampled, and steps ship KV per layer.
        self.core = EngineCore(self.worker, self.scheduler, overlap=False)
        # EAGLE-3 decode pool: each prompt's target hidden states ship with its KV, since
        # its head needs them (spec_decode/aux_rows.py). Prefill steps run eagerly then.
        self.aux_rows: PromptAuxRows | None = None
        if engine_config.speculative.speculative_method == "eagle3":
            self.aux_rows = PromptAuxRows()
            self.worker.runner.aux_observer = self.aux_rows.observe
        # Tensor parallel: rank 0 ships its KV heads, its ranks theirs; pipeline parallel: each
        # stage its own layers (kv_transfer/tp.py).
        # Each transfer announces the pool's format; a decode pool of another one refuses it.
        transfer = dataclasses.replace(transfer, kv_format=self.worker.runtime.kv_format)
        layout = self.worker.tp.layout(self.worker.spec)
        pool = self.worker.kv_cache.pool
        layers = self.worker.kv_cache.layers
        config = rank_transfer(transfer, layout, 0, layers, engine_config.pp)
        self.sender = create_sender(config, pool)
        if self.worker.runner.link is not None:
            self.sender = TPSender(self.sender, self.worker.runner.link)
        self.channel = NodeChannel(
            node_config.control_address, node_config.router_address, "prefill"
        )
        self.jobs: dict[str, PrefillJob] = {}
        self._ended = EndedRequests()
        self.info = runtime_info(self.worker.runtime)
        self.layers = self.worker.kv_cache.layers  # the model layers rank 0's pool holds
        self._stream_min_tokens = (
            node_config.ipc_stream_min_tokens if node_config.transport == "cuda_ipc" else 0
        )
        self.loop = NodeLoop(self, self.channel, node_config.drain_timeout_s)
        # Counters since start, reported in the heartbeat load (the router's /metrics).
        self.stats: Counter[str] = Counter()

    # -- the NodeLoop's role ----------------------------------------------------------------
    def run(self) -> None:
        self.loop.run(self.info)

    def stop(self) -> None:
        self.loop.stop()

    def step(self) -> None:
        self.loop.step()

    def idle(self) -> bool:
        return not self.jobs

    def has_work(self) -> bool:
        return self.core.has_work()

    def close(self) -> None:
        self.sender.close()
        self.worker.close()  # stops its tensor-parallel ranks

    def inbox_wait(self) -> float:
        """No wait while there are steps to run. Short while transfers are in flight (a sender
        moves them on, queued frames and completion notices, only when called, and their
        completion is on the path to the decode node's next token) or while the engine is
        stalled (its head prompt waits for blocks that mostly those transfers hold)."""
        if self.core.has_work() and not self.core.stalled:
            return 0.0
        if self.core.stalled or any(job.transferring for job in self.jobs.values()):
            return TRANSFER_WAIT_S
        return IDLE_WAIT_S

    def handle(self, message: object, decode_s: float = 0.0) -> None:
        """`decode_s`: how long parsing the message took (reported as node_decode)."""
        rid = getattr(message, "request_id", None)
        if rid in self._ended and not isinstance(message, Abort):
            self._crossed(rid, message)  # it crossed the request's end on the wire
            return
        if isinstance(message, PrefillRequest):
            job = self._job(message.request_id)
            if job.request is not None:
                self._ignore_repeat("repeated_requests", message)
                return
            job.request = message
            if message.deadline_s is not None:
                job.deadline = time.monotonic() + message.deadline_s
            # prefill_queue runs from here (node_decode before it) even if the Reservation
            # came first, so the node's phases never overlap the router's.
            job.arrived_at, job.decode_s = time.monotonic(), decode_s
            self._maybe_start(job)
        elif isinstance(message, Reservation):
            job = self._job(message.request_id)
            if job.reserved_blocks is not None:
                self._ignore_repeat("repeated_reservations", message)
                return
            job.reserved_blocks = message.block_ids.tolist()
            self._maybe_start(job)
        elif isinstance(message, Abort):
            if message.index is None:  # one sample's end concerns only the decode node
                self._abort(message.request_id)
        else:
            log.warning("prefill node ignores %s", type(message).__name__)

    # -- request handling -------------------------------------------------------------------
    def _job(self, request_id: str) -> PrefillJob:
        job = self.jobs.get(request_id)
        if job is None:
            # Until the request itself arrives (with the router's deadline), a job made by a
            # Reservation lives at most one transfer deadline: its request may never come.
            job = self.jobs[request_id] = PrefillJob(request_id)
            job.deadline = job.arrived_at + self.config.transfer_deadline_s
        return job

    def _ignore_repeat(self, counter: str, message: PrefillRequest | Reservation) -> None:
        """A second PrefillRequest or Reservation for a live job (a confused or hostile peer):
        the first one stands, since the job may already compute and ship by it."""
        self.stats[counter] += 1
        log.warning("ignored a repeated %s for %r", type(message).__name__, message.request_id)

    def _crossed(self, request_id: str, message: object) -> None:
        """A PrefillRequest or Reservation of an ended request: its decode node may hold (or be
        about to reserve) blocks that this node will never fill, so tell its receiver."""
        if isinstance(message, PrefillRequest) and self._ended[request_id] is None:
            self._ended.remember(request_id, message.decode_kv_address)
        address = self._ended[request_id]
        if address is not None and isinstance(message, (PrefillRequest, Reservation)):
            self.sender.decline(request_id, address, ENDED_BEFORE_TRANSFER)

    def expire(self, now: float) -> None:
        """Fail jobs past their deadline: the router gave up on them (its abort may be lost)."""
        for job in [j for j in self.jobs.values() if j.deadline is not None and now > j.deadline]:
            self.stats["expired_requests"] += 1
            self._fail(job.request_id, "the request passed its deadline on the prefill node", 504)

    def _maybe_start(self, job: PrefillJob) -> None:
        if job.request is None or job.reserved_blocks is None or job.seq is not None:
            return
        req = job.request
        try:
            seq = self.worker.new_sequence(req.request_id, req.prompt_token_ids, req.sampling)
            needed = self.scheduler.blocks_for(len(req.prompt_token_ids))
            check_reserved(job.reserved_blocks, needed)
            self.scheduler.add(seq)
        except (TypeError, ValueError) as exc:
            self._fail(req.request_id, str(exc), 400)
            return
        job.seq = seq
        if self.aux_rows is not None:
            self.aux_rows.expect(seq.request_id, len(seq.prompt_token_ids))

    def engine_step(self) -> None:
        for out in self.core.step(before_launch=self._before_launch):
            if out.error is not None:
                for item in out.batch.items:
                    self._fail(item.seq.request_id, f"prefill failed: {out.error}", 500)
                continue
            for seq in out.finished:
                self._first_token_ready(seq)

    def _before_launch(self, batch: ScheduledBatch) -> LayerHook | None:
        """Stamp first-scheduled times; begin the transfers of prompts that end in this step and
        return the hook that ships each layer once it is written."""
        now = time.monotonic()
        for item in batch.items:
            job = self.jobs.get(item.seq.request_id)
            if job is not None and job.scheduled_at is None:
                job.scheduled_at = now
        # Prompts that end in this step ship their KV layer by layer while later layers are
        # still computing: every earlier chunk is already in the cache, and the hook runs
        # once this step's layer is written. A short step (cuda_ipc) ships after its first
        # token instead, in one copy (_first_token_ready): per-layer sends cost host time
        # that its short compute cannot hide.
        shipping = [item.seq.request_id for item in batch.items if item.samples]
        if batch.num_tokens < self._stream_min_tokens or not shipping:
            return None
        for rid in shipping:
            self._begin_transfer(self.jobs[rid])
        shipping = [rid for rid in shipping if self.jobs[rid].transferring]
        if not shipping:
            return None

        def hook(layer: int) -> None:
            for rid in shipping:
                self.sender.send_layer(rid, layer)
            self.channel.publish_load(self.loop.load)  # live load during a long step

        return hook

    def _begin_transfer(self, job: PrefillJob) -> None:
        """Begin the job's KV transfer. A sender that refuses it (ValueError: _maybe_start
        checked the reservation, so a bug) leaves the reason in `job.transfer_error`, and
        _first_token_ready fails that request alone."""
        seq, req = job.seq, job.request
        try:
            self.sender.begin(
                seq.request_id, req.decode_kv_address, list(seq.block_ids), job.reserved_blocks
            )
        except ValueError as exc:
            log.error("the KV sender refused the transfer of %r: %s", seq.request_id, exc)
            job.transfer_error = str(exc)
            return
        job.transferring = True

    def _first_token_ready(self, seq: Sequence) -> None:
        job = self.jobs[seq.request_id]
        job.first_token_at = time.monotonic()
        self.stats["prefix_cache_queries"] += len(seq.prompt_token_ids)
        self.stats["prefix_cache_hits"] += seq.num_cached_tokens
        self.core.release(seq.request_id)
        finished = seq.finish_reason is not None
        # Nothing to decode unless the first token leaves something (or n > 1: the other
        # samples need the prompt's KV).
        ships = not finished or seq.params.n > 1
        streamed = job.transferring  # began in _before_launch, every layer sent during compute
        if ships and job.transfer_error is not None:  # _before_launch's begin was refused
            self._fail(seq.request_id, f"KV transfer failed: {job.transfer_error}", 500)
            return
        first = first_token(seq, job)
        self.channel.to_router(first)
        if not ships:
            # Stop the transfer (begun if this step streamed) and release the decode node's
            # reservation.
            self.sender.abort(seq.request_id, "finished at the first token")
            self.channel.to_peer(job.request.decode_node, Abort(seq.request_id))
            self._drop(job)
            return
        metadata = {
            "first_token": first.token_id,
            "logprob": first.logprob,
            "top_logprobs": first.top_logprobs,
            "timing": first.timing,
            # Same host only: the decode node compares it with its own monotonic clock.
            "first_token_at": job.first_token_at,
            "host_id": HOST_ID,
        }
        if not streamed:  # a short step: the token is out, now one copy of every layer
            self._begin_transfer(job)
            if not job.transferring:
                self._fail(seq.request_id, f"KV transfer failed: {job.transfer_error}", 500)
                return
            self.sender.send_layers(seq.request_id, self.layers)
        payload = None
        if self.aux_rows is not None:
            # After the first token left: the device-to-host copy is off the TTFT path.
            shipped = self.aux_rows.to_wire(seq.request_id)
            if shipped is not None:
                metadata[AUX_ROWS_KEY], payload = shipped
        self.sender.complete(seq.request_id, metadata, payload)

    def poll_transport(self) -> None:
        for transfer in self.sender.poll():
            job = self.jobs.get(transfer.request_id)
            if job is None:
                continue
            if transfer.state is TransferState.FAILED:
                self.stats["kv_transfer_failures"] += 1
                self._fail(job.request_id, f"KV transfer failed: {transfer.error}", 500)
            else:
                self._drop(job)

    # -- endings ----------------------------------------------------------------------------
    def _abort(self, request_id: str) -> None:
        job = self.jobs.get(request_id)
        if job is None:
            self._ended.remember(request_id, None)  # the abort may overtake the request itself
            return
        if job.transferring:
            self.sender.abort(request_id, "aborted by the router")
        self._drop(job)

    def _fail(self, request_id: str, message: str, status: int) -> None:
        job = self.jobs.get(request_id)
        self.channel.to_router(RequestError(request_id, message, status))
        if job is not None:
            if job.request is not None:
                self.channel.to_peer(job.request.decode_node, Abort(request_id))
            if job.transferring:
                self.sender.abort(request_id, message)
            self._drop(job)

    def _drop(self, job: PrefillJob) -> None:
        """Forget a job and free its blocks (the one place a prefill node frees them)."""
        self.jobs.pop(job.request_id, None)
        address = job.request.decode_kv_address if job.request is not None else None
        self._ended.remember(job.request_id, address)
        if address is not None and job.reserved_blocks is not None and not job.transferring:
            # Ended before its transfer began (its first token finished it, an abort, an
            # error): the decode node's receiver may hold the reservation until told.
            self.sender.decline(job.request_id, address, ENDED_BEFORE_TRANSFER)
        self.core.release(job.request_id)
        if self.aux_rows is not None:
            self.aux_rows.release(job.request_id)
        seq = job.seq
        if seq is None:
            return
        if not seq.is_finished:
            self.scheduler.abort(seq.request_id)  # frees its blocks
        elif seq.block_ids:
            self.worker.allocator.free(seq.block_ids)
            seq.block_ids = []

    def load(self) -> dict[str, int | float]:
        allocator = self.worker.allocator
        stats = allocator.stats()
        queued = sum(s.num_pending_tokens for s in self.scheduler.waiting)
        queued += sum(s.num_pending_tokens for s in self.scheduler.running)
        return {
            "free_blocks": stats.num_free + stats.num_cached,
            "used_blocks": stats.num_used,
            "prefix_queried_blocks": allocator.prefix_queried_blocks,
            "prefix_hit_blocks": allocator.prefix_hit_blocks,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting)
            + sum(1 for j in self.jobs.values() if j.seq is None),
            "queued_tokens": queued,
            "transferring": sum(1 for j in self.jobs.values() if j.transferring),
            "invalid_messages": self.channel.invalid_messages,
            "undelivered_messages": self.channel.undelivered_messages,
            **self.stats,
        }
