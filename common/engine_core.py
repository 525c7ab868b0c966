"""The one engine step loop: schedule -> run the model -> update sequences.

`LLMEngine` (offline), `PrefillNode` and `DecodeNode` each own one `EngineCore` and call
`step()` from their loops; what differs between them (admission, KV transfer, messages) sits
around it in the caller. A step that fails (an exception in the model) comes back as a
`StepOutput` with `error` set: the caller fails that step's requests, the loop goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from common.scheduler import SampledToken, ScheduledBatch, Scheduler
from common.sequence import FinishReason, Sequence
from common.worker import Worker

log = logging.getLogger(__name__)

LayerHook = Callable[[int], None]
# Called with each batch just before it runs; may return a per-layer hook (prefill node: ship
# the layer's KV once it is written).
BeforeLaunch = Callable[[ScheduledBatch], LayerHook | None]


@dataclass
class StepOutput:
    """One model step, once its sampled tokens are on the host and the sequences updated."""

    batch: ScheduledBatch
    sampled: list[SampledToken | None] = field(default_factory=list)  # one per batch item
    finished: list[Sequence] = field(default_factory=list)  # ended at this step
    error: Exception | None = None  # the step failed: none of its requests advanced

    def new_tokens(self) -> list[tuple[Sequence, SampledToken]]:
        """(sequence, token) for every row that sampled, in batch order."""
        return [
            (item.seq, token)
            for item, token in zip(self.batch.items, self.sampled, strict=True)
            if token is not None
        ]


class EngineCore:
    def __init__(self, worker: Worker, scheduler: Scheduler) -> None:
        self.worker = worker
        self.scheduler = scheduler
        self.runner = worker.runner

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self, before_launch: BeforeLaunch | None = None) -> list[StepOutput]:
        """Run one step; returns its output ([] when nothing was scheduled)."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        hook = before_launch(batch) if before_launch is not None else None
        try:
            sampled = self.runner.execute(batch, on_layer_done=hook)
        except Exception as exc:  # a failed step fails its requests, not the loop
            log.exception("model step of %d requests failed", len(batch.items))
            return [StepOutput(batch, error=exc)]
        finished = self.scheduler.update(batch, sampled)
        return [StepOutput(batch, sampled, finished)]

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Sequence | None:
        """End a request wherever it is in the scheduler (its blocks are freed) and forget its
        sampler state; None if the scheduler does not hold it."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            seq.finish_reason = reason
        self.runner.release(request_id)
        return seq

    def release(self, request_id: str) -> None:
        """Forget per-request runner state once a request has ended."""
        self.runner.release(request_id)
