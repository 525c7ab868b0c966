"""What a decode node keeps per request: one `Request`, created on accept, ended in one place
(`DecodeNode._end`).

Phases (PD): QUEUED (waiting for blocks) -> RESERVED (blocks held, KV receiver expects them)
-> RUNNING (its sequences are in the engine). Colocated requests start RUNNING. An aborted
RESERVED request whose blocks a sender may still write (cuda_ipc) is QUARANTINED until the
receiver reports its transfer over; only then are the blocks freed and the record dropped.

Block ownership: `block_ids` (reserved, PD) belong to the record until admission hands them
to its first sequence; from then on the sequences own their blocks (the scheduler frees them).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from common.engine.sequence import Sequence
from common.protocol.messages import DecodeRequest


class Phase(enum.Enum):
    QUEUED = "queued"
    RESERVED = "reserved"
    RUNNING = "running"
    QUARANTINED = "quarantined"


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


@dataclass(eq=False)
class Request:
    message: DecodeRequest
    seq: Sequence  # sample 0, built (and validated) on accept; its id is the request id
    timing: DecodeTiming
    deadline: float | None = None  # monotonic; past it the node drops the request
    phase: Phase = Phase.QUEUED
    block_ids: list[int] = field(default_factory=list)  # reserved for the prompt's KV (PD)
    # Ids of its samples still in the engine (n > 1: `seq` and its forks, see choices.py).
    samples: set[str] = field(default_factory=set)
    forked: bool = False  # samples 1..n-1 started
    expecting: bool = False  # the KV receiver expects its transfer (RESERVED, QUARANTINED)

    @property
    def id(self) -> str:
        return self.message.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.message.prompt_token_ids)
