"""The single-process engine behind the offline `LLM` API: prefill and decode in one loop.
Its step is the whole story: schedule -> run the model -> update sequences -> report.
(The decode node's `--colocated` mode runs the same Worker and Scheduler inside its own
event loop, which also speaks ZMQ.)
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import EngineConfig
from common.sampling_params import SamplingParams
from common.scheduler import Scheduler
from common.sequence import FinishReason, Sequence
from common.worker import RuntimeInfo, Worker


@dataclass
class StepEvent:
    """What one step did to one request: the token it appended and whether it ended."""

    seq: Sequence
    new_token_ids: list[int]
    finished: bool


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.worker = Worker(config)
        self.scheduler = Scheduler(config.scheduler, self.worker.allocator)
        self.sequences: dict[str, Sequence] = {}

    @property
    def runtime(self) -> RuntimeInfo:
        return self.worker.runtime

    @property
    def tokenizer(self):
        return self.worker.tokenizer

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Sequence:
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already running")
        seq = self.worker.new_sequence(request_id, prompt_token_ids, params)
        self.scheduler.add(seq)
        self.sequences[request_id] = seq
        return seq

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Sequence | None:
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            seq.finish_reason = reason
        self._forget(request_id)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepEvent]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        sampled = self.worker.runner.execute(batch)
        self.scheduler.update(batch, sampled)
        events = []
        for item, token in zip(batch.items, sampled, strict=True):
            if token is None:
                continue
            events.append(StepEvent(item.seq, [token.token_id], item.seq.is_finished))
            if item.seq.is_finished:
                self._forget(item.seq.request_id)
        return events

    def _forget(self, request_id: str) -> None:
        self.sequences.pop(request_id, None)
        self.worker.runner.release(request_id)
