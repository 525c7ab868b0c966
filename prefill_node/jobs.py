"""What a prefill node keeps per request: the live job, and the ids of recently ended ones."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from common.engine.sequence import Sequence
from common.protocol.messages import FirstToken, PrefillRequest

ENDED_MEMORY = 10_000


@dataclass
class PrefillJob:
    request_id: str
    arrived_at: float = field(default_factory=time.monotonic)
    request: PrefillRequest | None = None
    reserved_blocks: list[int] | None = None
    seq: Sequence | None = None
    scheduled_at: float | None = None
    first_token_at: float | None = None
    decode_s: float = 0.0  # parsing the PrefillRequest
    transferring: bool = False
    transfer_error: str | None = None  # the sender refused to begin the transfer (a bug)
    deadline: float | None = None  # monotonic; past it the job is failed (see PrefillNode.expire)


def first_token(seq: Sequence, job: PrefillJob) -> FirstToken:
    """The router's FirstToken for `job`, whose sequence just sampled its first token."""
    finished = seq.finish_reason is not None
    top = seq.output_top_logprobs[0] if seq.output_top_logprobs else None
    return FirstToken(
        request_id=seq.request_id,
        token_id=seq.output_token_ids[0],
        logprob=seq.output_logprobs[0] if seq.output_logprobs else None,
        top_logprobs=[[t, lp] for t, lp in top] if top is not None else None,
        finished=finished,
        finish_reason=seq.finish_reason.value if finished else None,
        num_cached_tokens=seq.num_cached_tokens,
        timing={
            "node_decode": job.decode_s,
            "prefill_queue": job.scheduled_at - job.arrived_at,
            "prefill_compute": job.first_token_at - job.scheduled_at,
        },
        prompt_logprobs=seq.prompt_logprobs(),
    )


def check_reserved(block_ids: list[int], needed: int) -> None:
    """ValueError unless the decode node reserved `needed` distinct block ids, none negative
    (their upper bound is that node's pool, which only its receiver knows)."""
    if len(block_ids) != needed:
        raise ValueError(f"decode node reserved {len(block_ids)} blocks, {needed} needed")
    if min(block_ids) < 0 or len(set(block_ids)) != len(block_ids):
        raise ValueError(f"decode node reserved negative or repeated block ids: {block_ids[:8]}")


class EndedRequests:
    """Recently ended request ids (the newest ENDED_MEMORY), each with its decode node's KV
    address once known: a Reservation or request that crossed the end on the wire is
    recognised, and the decode node's receiver can be told (KVSender.decline)."""

    def __init__(self) -> None:
        self._ended: OrderedDict[str, str | None] = OrderedDict()

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ended

    def __getitem__(self, request_id: str) -> str | None:
        return self._ended[request_id]

    def remember(self, request_id: str, decode_kv_address: str | None) -> None:
        self._ended[request_id] = decode_kv_address
        while len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)
