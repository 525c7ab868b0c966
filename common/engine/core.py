"""The one engine step loop: schedule -> run the model -> update sequences.

`LLMEngine` (offline), `PrefillNode` and `DecodeNode` each own one `EngineCore` and call
`step()` from their loops; what differs between them (admission, KV transfer, messages) sits
around it in the caller. A step that fails (an exception in the model) comes back as a
`StepOutput` with `error` set: the caller fails that step's requests, the loop goes on. So does
an exception in the caller's `before_launch` hook (the step then never runs).

Overlapped (`overlap=True`, vLLM's async scheduling, SGLang's overlap scheduler): each `step()`
schedules and launches step N+1 while step N may still run on the device, and only then waits
for step N and returns its output. Sampled ids stay on the device and feed step N+1's inputs
there (`ModelRunner.launch`); stop checks and everything the caller does with the output (stop
strings, TokenBatch messages) run one step behind, while the device works. A sequence that
stops at step N may have a row in step N+1: that row is dropped. Both modes produce the same
tokens: the synchronous loop is the overlapped one with the wait moved up.

Speculative decoding (a `Proposer`): steps that may speculate run synchronously, since a
proposer reads every token so far on the host; above `speculative_max_batch` running sequences
nothing is drafted and the loop overlaps again. After `Scheduler.schedule` the proposer drafts tokens for the items
the scheduler allowed (`ScheduledBatch.spec_limits`), and the runner verifies them in the same
forward; a row's output is then the list of tokens it emitted.

Pipelined (a node of `pp` stages): up to `pp` steps are in flight, so while later stages run
step N stage 0 already runs N+1 (prefill chunks of one prompt or of several, back to back);
outputs come back in order, each once its logits left the last stage. A step never reads a
token still in flight: before scheduling a sequence whose last token is a placeholder (a
decode), every step in flight is resolved first, so decode steps of a pipelined node run
synchronously. Blocks freed while steps are in flight wait for the newest of them.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from common.engine.scheduler import SampledToken, ScheduledBatch, Scheduler
from common.engine.sequence import PLACEHOLDER, FinishReason, Sequence
from common.engine.spec_decode.proposer import Proposer
from common.engine.step_handle import StepHandle
from common.engine.worker import Worker

log = logging.getLogger(__name__)

LayerHook = Callable[[int], None]
# Called with each batch just before it runs; may return a per-layer hook (prefill node: ship
# the layer's KV once it is written).
BeforeLaunch = Callable[[ScheduledBatch], LayerHook | None]


@dataclass
class StepOutput:
    """One model step, once its sampled tokens are on the host and the sequences updated."""

    batch: ScheduledBatch
    # One per batch item: the tokens it added (one, several for a verify step, none where
    # the item had no sampling row or its sequence had ended before the step resolved).
    sampled: list[list[SampledToken]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # ended at this step
    error: Exception | None = None  # the step failed: none of its requests advanced

    def new_tokens(self) -> list[tuple[Sequence, SampledToken]]:
        """(sequence, token) for every token added, in batch order (a sequence's tokens in
        order). A sequence that finished did so at its last token here."""
        return [
            (item.seq, token)
            for item, tokens in zip(self.batch.items, self.sampled, strict=True)
            for token in tokens
        ]


class EngineCore:
    def __init__(
        self,
        worker: Worker,
        scheduler: Scheduler,
        overlap: bool = False,
        proposer: Proposer | None = None,
    ) -> None:
        self.worker = worker
        self.scheduler = scheduler
        self.runner = worker.runner
        self.overlap = overlap
        self.proposer = proposer
        self._in_flight: StepHandle | None = None
        # Pipelined: launched, unresolved steps, oldest first, each with the blocks to free
        # once it has completed.
        self.depth = worker.config.pp
        self._pipeline: deque[tuple[StepHandle, list[int]]] = deque()
        # The last step() found work but scheduled, preempted and resolved nothing: the head
        # waiting prompt's blocks are not free. Until something outside the scheduler frees
        # some (an ending, a finished transfer), stepping again changes nothing, so a loop
        # should wait for that rather than spin.
        self.stalled = False

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None or bool(self._pipeline)

    def step(self, before_launch: BeforeLaunch | None = None) -> list[StepOutput]:
        """Run one step. Synchronous: its output. Overlapped: launch the next step, then return
        the previous one's output. Pipelined: launch the next step, then return the outputs of
        the oldest ones beyond `depth - 1` in flight. [] when there was nothing to resolve."""
        if self.depth > 1:
            return self._step_pipelined(before_launch)
        early: list[StepOutput] = []
        sync = self._needs_host_tokens()
        if sync and self._in_flight is not None:
            early.append(self._resolve(self._in_flight))  # see _needs_host_tokens
            self._in_flight = None
            self.scheduler.hold_frees = False
            self.worker.allocator.free(self.scheduler.take_held())
        batch = self.scheduler.schedule()
        # Blocks released before this schedule belong to no sequence of `batch`; the step in
        # flight may still write them, so they wait for it (`Scheduler.hold_frees`).
        held = self.scheduler.take_held()
        outputs: list[StepOutput] = []
        launched = None
        if batch:
            launched = self._launch(batch, before_launch, self._in_flight, outputs)
        if self._in_flight is not None:
            outputs.insert(0, self._resolve(self._in_flight))
        self._in_flight = launched
        self.worker.allocator.free(held)
        if launched is not None and (not self.overlap or sync):
            outputs.append(self._resolve(launched))
            self._in_flight = None
        if self._in_flight is None:  # nothing runs: every held block is free again
            self.scheduler.hold_frees = False
            self.worker.allocator.free(self.scheduler.take_held())
        progressed = batch or batch.preempted or early or outputs
        self.stalled = not progressed and self.scheduler.has_work()
        return early + outputs

    def _step_pipelined(self, before_launch: BeforeLaunch | None) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        if self._pipeline and (self._needs_host_tokens() or self._reads_unresolved()):
            outputs += self._drain(0)
        batch = self.scheduler.schedule()
        held = self.scheduler.take_held()
        if self._pipeline:  # freed before this schedule: a step in flight may still write them
            self._pipeline[-1][1].extend(held)
        else:
            self.worker.allocator.free(held)
        if batch:
            launched = self._launch(batch, before_launch, None, outputs)
            if launched is not None:
                self._pipeline.append((launched, []))
        # Launched: keep depth - 1 others in flight. Nothing launched: resolve the oldest, the
        # only way on (the rest wait for its tokens or blocks).
        outputs += self._drain(self.depth - 1 if batch else len(self._pipeline) - 1)
        progressed = batch or batch.preempted or outputs
        self.stalled = not progressed and self.scheduler.has_work()
        return outputs

    def _launch(
        self,
        batch: ScheduledBatch,
        before_launch: BeforeLaunch | None,
        prev: StepHandle | None,
        outputs: list[StepOutput],
    ) -> StepHandle | None:
        """Draft (when the scheduler allowed it), launch and commit `batch`; None, with its
        failure appended to `outputs`, when that raised: a failed step fails its requests,
        not the loop."""
        try:
            if batch.spec_limits:
                drafts = self.proposer.propose(batch, batch.spec_limits)
                batch.drafts, batch.draft_probs = drafts.token_ids, drafts.probs
            hook = before_launch(batch) if before_launch is not None else None
            launched = self.runner.launch(batch, prev, hook)
        except Exception as exc:
            log.exception("model step of %d requests failed", len(batch.items))
            outputs.append(StepOutput(batch, error=exc))
            return None
        self.scheduler.commit(batch)
        self.scheduler.hold_frees = True
        return launched

    def _drain(self, keep: int) -> list[StepOutput]:
        """Resolve the oldest steps in flight until at most `keep` are."""
        outputs = []
        while len(self._pipeline) > max(0, keep):
            handle, blocks = self._pipeline.popleft()
            outputs.append(self._resolve(handle))
            self.worker.allocator.free(blocks)
        if not self._pipeline:  # nothing runs: every held block is free again
            self.scheduler.hold_frees = False
            self.worker.allocator.free(self.scheduler.take_held())
        return outputs

    def _reads_unresolved(self) -> bool:
        """A running sequence's next input is a token still in flight (a decode)."""
        s = self.scheduler
        return any(
            seq.output_token_ids[-1:] == [PLACEHOLDER] and not seq.awaiting_last_token
            for seq in s.running
            if not (s.prefill_only and seq.output_token_ids)
        )

    def _needs_host_tokens(self) -> bool:
        """A request with a grammar is in the scheduler: its matcher reads the tokens sampled so
        far on the host before its next mask (`common.engine.logits_processors`), so steps run
        synchronously (no placeholder tokens) while one is there. So do steps that may
        speculate: the proposer reads every token so far."""
        s = self.scheduler
        if self.proposer is not None and s.may_speculate():
            return True
        return any(
            seq.params.structured is not None
            for queue in (s.running, s.ready, s.waiting)
            for seq in queue
        )

    def _resolve(self, handle: StepHandle) -> StepOutput:
        batch = handle.batch
        try:
            sampled = handle.result()
        except Exception as exc:
            log.exception("model step of %d requests failed", len(batch.items))
            return StepOutput(batch, error=exc)
        live = [not item.seq.is_finished for item in batch.items]
        finished = self.scheduler.resolve(batch, sampled)
        added: list[list[SampledToken]] = []
        for item, index, tokens, ok in zip(
            batch.items, batch.output_index, sampled, live, strict=True
        ):
            if not ok or tokens is None or index is None:
                added.append([])
                continue
            tokens = [tokens] if isinstance(tokens, SampledToken) else tokens
            # A stop inside a verify step's run: the tokens after it were never appended.
            added.append(tokens[: len(item.seq.output_token_ids) - index])
        return StepOutput(batch, added, finished)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Sequence | None:
        """End a request wherever it is in the scheduler (its blocks are freed, or held until
        the step in flight completes) and forget its sampler state; None if the scheduler does
        not hold it."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            seq.finish_reason = reason
        self.release(request_id)
        return seq

    def release(self, request_id: str) -> None:
        """Forget per-request runner and proposer state once a request has ended."""
        self.runner.release(request_id)
        if self.proposer is not None:
            self.proposer.release(request_id)
