"""How requests reach a decode node's engine: the part `DecodeNode` composes per mode.

`PDAdmission` (PD): reserves blocks in FIFO order, tells the KV receiver and the prefill node,
and admits a request once its KV landed. `LocalPrefill` (`--colocated`): the request goes
straight into the scheduler and is prefilled here. Both yield `Landed` / `Dropped` outcomes
from `poll`, which the node acts on (starting samples, ending requests) as each comes.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from common.engine.config import EngineConfig
from common.engine.scheduler import Scheduler
from common.engine.spec_decode.aux_rows import AUX_ROWS_KEY, observe_shipped
from common.engine.spec_decode.eagle3 import Eagle3Proposer
from common.engine.tp_ranks import RankRole
from common.engine.worker import Worker
from common.node.channel import HOST_ID, NodeChannel
from common.node.config import NodeConfig
from common.protocol.messages import DecodeRequest, PromptLogprobs, RequestError, Reservation
from decode_node.request import Phase, Request
from decode_node.reservations import ReservationQueue
from kv_transfer import Transfer, TransferConfig, TransferState, create_receiver
from kv_transfer.tp import check_transport, decode_rank_handler, tp_receiver

log = logging.getLogger(__name__)


@dataclass
class Landed:
    """The request's KV landed: its first sequence is running (`first_finished`: the prefill
    node's token already ended sample 0, which then only lends its blocks to the others)."""

    request: Request
    first_finished: bool


@dataclass
class Dropped:
    """End the request; tell the router `error` unless None (someone else answered it)."""

    request: Request
    error: RequestError | None


Lookup = Callable[[str], Request | None]


class LocalPrefill:
    role = "colocated"

    @staticmethod
    def rank_role(config: NodeConfig, engine_config: EngineConfig) -> RankRole | None:
        return None

    def __init__(
        self,
        config: NodeConfig,
        worker: Worker,
        scheduler: Scheduler,
        channel: NodeChannel,
        stats: Counter[str],
    ) -> None:
        """`stats`: the node's counters (reported in its heartbeat load)."""
        self.scheduler, self.stats = scheduler, stats
        self.info: dict[str, Any] = {}
        self.num_queued = 0

    def refuse(self, message: DecodeRequest) -> str | None:
        return None if message.prefill_node is None else "a colocated node takes no prefill node"

    def accept(self, request: Request) -> None:
        self.scheduler.add(request.seq)
        request.phase = Phase.RUNNING
        request.samples.add(request.id)

    def poll(self, lookup: Lookup, wait_s: float) -> Iterator[Landed | Dropped]:
        return iter(())

    def busy(self) -> bool:
        return False

    def release(self, request: Request) -> bool:
        return True

    def first_report(self, request: Request) -> dict[str, float]:
        """The TTFT phases are this node's; its prefix cache answered the prompt."""
        timing, seq = request.timing, request.seq
        self.stats["prefix_cache_queries"] += len(seq.prompt_token_ids)
        self.stats["prefix_cache_hits"] += seq.num_cached_tokens
        start = timing.first_step_at or timing.arrived_at
        return {
            "node_decode": timing.decode_s,
            "prefill_queue": start - timing.arrived_at,
            "prefill_compute": time.monotonic() - start,
        }

    def prompt_logprobs(self, request: Request) -> PromptLogprobs | None:
        """This node prefilled the prompt: its logprobs, when asked, go with the first token."""
        return request.seq.prompt_logprobs()

    def load(self) -> dict[str, int]:
        return {"reserved": 0, "quarantined": 0, "kv_late_frames": 0, "kv_malformed_frames": 0}

    def close(self) -> None:
        pass


class PDAdmission:
    role = "decode"

    @staticmethod
    def rank_role(config: NodeConfig, engine_config: EngineConfig) -> RankRole | None:
        """What the node's tensor-parallel ranks run; ValueError for a transport they lack, or
        for pipeline stages (received KV would have to be forwarded between them)."""
        if engine_config.pp > 1:
            raise ValueError(
                f"a decode node receiving KV runs one pipeline stage; this one has "
                f"pp={engine_config.pp} (pipeline-parallel decode runs --colocated; in PD, "
                "use --decode-tp and pipeline the prefill pool with --prefill-pp)"
            )
        check_transport(config.transport, engine_config.tp)
        return RankRole(partial(decode_rank_handler, config.transport))

    def __init__(
        self,
        config: NodeConfig,
        worker: Worker,
        scheduler: Scheduler,
        channel: NodeChannel,
        stats: Counter[str],
    ) -> None:
        """`stats`: the node's counters (reported in its heartbeat load)."""
        self.scheduler, self.channel, self.stats = scheduler, channel, stats
        self.allocator = worker.allocator
        pool = worker.kv_cache.pool
        # The receiver refuses KV from a pool of another format (KVReceiver, check_format).
        transfer = TransferConfig(
            transport=config.transport,
            deadline_s=config.transfer_deadline_s,
            kv_format=worker.runtime.kv_format,
        )
        self.receiver = create_receiver(transfer, pool, config.kv_address)
        if worker.runner.link is not None:  # rank 0 hands the ranks their heads
            tp_receiver(self.receiver, worker, config.transport)
        self.info = {"kv_address": self.receiver.address}
        self.queue = ReservationQueue(self.allocator)
        self.num_reserved = 0
        self.num_quarantined = 0
        self._headroom_blocks = math.ceil(config.kv_growth_headroom * self.allocator.num_blocks)
        # EAGLE-3: the head is fed the prompt hidden states the prefill node ships. Without
        # it they are ignored (a pool of another method is refused anyway: KVFormat).
        proposer = worker.proposer
        self._eagle3 = proposer if isinstance(proposer, Eagle3Proposer) else None

    @property
    def num_queued(self) -> int:
        return len(self.queue.waiting)

    def refuse(self, message: DecodeRequest) -> str | None:
        return "this decode node needs a prefill node" if message.prefill_node is None else None

    def accept(self, request: Request) -> None:
        self.queue.add(request)

    def busy(self) -> bool:
        """Transfers in flight (reserved or quarantined blocks): the KV receiver matters next."""
        return bool(self.num_reserved or self.num_quarantined)

    def poll(self, lookup: Lookup, wait_s: float) -> Iterator[Landed | Dropped]:
        """Reserve what fits, then take the transfers that ended. Lazy: the node ends a
        dropped request (freeing its blocks) before the next reservation is tried."""
        while (keep_free := self._growth_headroom()) is not None:
            request = self.queue.reserve_next(keep_free)
            if request is None:
                break
            self.num_reserved += 1
            request.expecting = True
            self.receiver.expect(request.id, request.block_ids)
            prefill_node = request.message.prefill_node
            reservation = Reservation(request.id, self.channel.node_id, request.block_ids)
            if not self.channel.to_peer(prefill_node, reservation):
                self.receiver.withdraw(request.id)  # no sender knows the blocks: free them now
                request.expecting = False
                error = RequestError(request.id, f"cannot reach prefill node {prefill_node!r}", 503)
                yield Dropped(request, error)
        for transfer in self.receiver.poll(timeout_s=wait_s if self.busy() else 0.0):
            request = lookup(transfer.request_id)
            if request is not None and request.expecting:
                request.expecting = False
                yield self._transfer_ended(request, transfer)

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
        if not (self.scheduler.running or self.scheduler.ready or self.num_reserved):
            return 0
        return self._headroom_blocks

    def _transfer_ended(self, request: Request, transfer: Transfer) -> Landed | Dropped:
        if request.phase is Phase.QUARANTINED:  # nothing writes into its blocks any more
            return Dropped(request, None)
        if transfer.state is TransferState.FAILED:
            if transfer.answered_by_sender:
                # The prefill node ended the request (its first token finished it, the router
                # aborted it, or it failed and said so): the router heard it from there, and an
                # error from here could overtake that first token on the router's socket.
                self.stats["kv_transfers_ended_by_sender"] += 1
                return Dropped(request, None)
            self.stats["kv_transfer_failures"] += 1
            message = f"KV transfer failed: {transfer.error}"
            return Dropped(request, RequestError(request.id, message, 500))
        meta, timing = transfer.metadata or {}, request.timing
        timing.kv_landed_at = transfer.finished_at or time.monotonic()
        timing.kv_first_frame_at = transfer.in_flight_at
        # The transport's own count (whole blocks, every head the node's ranks received).
        self.stats["kv_transfer_bytes"] += transfer.nbytes
        start = transfer.in_flight_at or timing.reserved_at or timing.kv_landed_at
        self.stats["kv_transfer_seconds"] += timing.kv_landed_at - start
        timing.prefill_timing = {k: float(v) for k, v in (meta.get("timing") or {}).items()}
        if meta.get("host_id") == HOST_ID and isinstance(meta.get("first_token_at"), float):
            timing.prefill_first_token_at = meta["first_token_at"]
        seq = request.seq  # the blocks pass from the request to its sequence
        seq.block_ids, request.block_ids = request.block_ids, []
        seq.num_computed_tokens = request.num_prompt_tokens
        ended = seq.append_token(int(meta["first_token"]))
        self._observe_prompt(request, meta.pop(AUX_ROWS_KEY, None), transfer.payload)
        self.scheduler.add_running(seq)
        self.num_reserved -= 1
        request.phase = Phase.RUNNING
        request.samples.add(request.id)
        return Landed(request, ended is not None)

    def _observe_prompt(self, request: Request, rows: Any, payload: Any) -> None:
        """Before the sequence's first step: its head takes the shipped rows (the proposer
        forgets them when the request ends). Rows that do not fit are dropped with a warning:
        the output stays exact, only acceptance drops."""
        if rows is None or self._eagle3 is None:
            return
        try:
            n = observe_shipped(self._eagle3, request.id, rows, payload, request.num_prompt_tokens)
        except ValueError as exc:
            self.stats["eagle3_aux_rows_refused"] += 1
            log.warning("dropped the prompt hidden states shipped for %r: %s", request.id, exc)
            return
        self.stats["eagle3_aux_rows_received"] += n

    def release(self, request: Request) -> bool:
        """The request ends: forget it here. True: its blocks may be freed now; False: a sender
        may still write them (cuda_ipc, see KVReceiver.cancel): it stays QUARANTINED, and
        `poll` drops it once the receiver reports the transfer over."""
        if request.phase is Phase.QUEUED:
            self.queue.remove(request)
        elif request.phase is Phase.RESERVED:
            self.num_reserved -= 1
            if request.expecting and not self.receiver.cancel(request.id):
                request.phase = Phase.QUARANTINED
                self.num_quarantined += 1
                return False
            request.expecting = False
        elif request.phase is Phase.QUARANTINED:
            if request.expecting:
                return False
            self.num_quarantined -= 1
        return True

    def first_report(self, request: Request) -> dict[str, float]:
        return {}

    def prompt_logprobs(self, request: Request) -> PromptLogprobs | None:
        """None: the prefill node sent them to the router with the first token."""
        return None

    def load(self) -> dict[str, int]:
        return {
            "reserved": self.num_reserved,
            "quarantined": self.num_quarantined,
            "kv_late_frames": self.receiver.late_frames,
            "kv_malformed_frames": self.receiver.malformed_frames,
        }

    def close(self) -> None:
        self.receiver.close()


Admission = PDAdmission | LocalPrefill
ADMISSIONS: dict[bool, type[Admission]] = {False: PDAdmission, True: LocalPrefill}  # by colocated
