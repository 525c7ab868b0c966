"""The single-process engine behind the offline `LLM` API: `EngineCore.step` reported per
request."""

from __future__ import annotations

from dataclasses import dataclass

from common.engine.config import EngineConfig
from common.engine.core import EngineCore
from common.engine.sequence import FinishReason, Sequence
from common.engine.spec_decode.factory import build_proposer, decoding_scheduler
from common.engine.worker import RuntimeInfo, Worker
from common.protocol.sampling_params import SamplingParams


@dataclass
class StepEvent:
    """What one step did to one request: the token it appended and whether it ended."""

    seq: Sequence
    new_token_ids: list[int]
    finished: bool


class LLMEngine:
    def __init__(self, config: EngineConfig, worker: Worker | None = None) -> None:
        """`worker`: one already built from the same config (benchmarks reuse a loaded model)."""
        self.config = config
        self.worker = worker or Worker(config)
        self.scheduler = decoding_scheduler(config, self.worker.allocator)
        self.core = EngineCore(
            self.worker,
            self.scheduler,
            overlap=config.overlap_scheduling,
            proposer=build_proposer(config, self.worker),
        )
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
        if params.n != 1:
            raise ValueError(
                f"n={params.n}: several samples per prompt are served by the decode node"
            )
        seq = self.worker.new_sequence(request_id, prompt_token_ids, params)
        self.scheduler.add(seq)
        self.sequences[request_id] = seq
        return seq

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Sequence | None:
        seq = self.core.abort(request_id, reason)
        self.sequences.pop(request_id, None)
        return seq

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (idempotent)."""
        self.worker.close()

    def has_unfinished(self) -> bool:
        return self.core.has_work()

    def step(self) -> list[StepEvent]:
        events = []
        for out in self.core.step():
            if out.error is not None:
                raise out.error  # offline: a failing model step is the caller's error
            # One call may return two steps (the one in flight, then a synchronous one): a
            # sequence finished in the step that lists it in `finished`, not before.
            ended = {id(seq) for seq in out.finished}
            for item, tokens in zip(out.batch.items, out.sampled, strict=True):
                if not tokens:
                    continue
                seq = item.seq
                finished = id(seq) in ended
                events.append(StepEvent(seq, [t.token_id for t in tokens], finished))
                if finished:
                    self.sequences.pop(seq.request_id, None)
                    self.core.release(seq.request_id)
        return events
