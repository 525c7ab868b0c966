"""A launched model step: its sampled ids on the device (the next step reads them) and the
host copy `result` waits for.

`ModelRunner.launch` returns one at once; the ids are copied to pinned host memory with one
non-blocking copy and an event, so the host reads them only when `result` is called (one step
later in the overlapped loop). A pipelined step samples only when the last stage's logits
arrived: `finish` runs first in `result`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.engine.cuda_graphs import Replay
from common.engine.sampler import (
    SampledRows,
    SamplingPlan,
    VerifiedRows,
    VerifyPlan,
    host_output,
    verified_output,
)
from common.engine.scheduler import SampledToken, ScheduledBatch


class StepHandle:
    """A launched step. `token_ids` (device) feed the next step; `result()` waits for the step
    (its event), releases its staging slot and returns one entry per batch item (None where no
    token was sampled)."""

    def __init__(self, batch: ScheduledBatch, sample_rows: list[int]) -> None:
        self.batch = batch
        self.sample_rows = sample_rows
        self.token_ids: torch.Tensor | None = None
        self.plan: SamplingPlan | None = None
        self.replay: Replay | None = None
        self._host: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._event: torch.cuda.Event | None = None
        self._results: list[SampledToken | None] | None = None
        # Pipeline stage 0: samples once the last stage's logits arrived (run by `result`).
        self.finish: Callable[[], None] | None = None

    def mark_launched(self) -> None:
        """A step that samples nothing: `result` waits for what was queued so far before it
        gives the staging slot back (an event on CUDA; nothing to wait for on CPU)."""
        if self.replay is not None and self.replay.output.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def sampled_row(self) -> dict[str, int]:
        """Request id -> row of `token_ids`."""
        items = self.batch.items
        return {items[r].seq.request_id: i for i, r in enumerate(self.sample_rows)}

    def set_verified(self, out: VerifiedRows, plan: VerifyPlan) -> None:
        """A verify step: keep its emitted ids on the device, queue their copy (ids, counts,
        logprobs if asked) to pinned host memory and an event."""
        self.plan = plan
        self.token_ids = out.token_ids
        tensors = [out.token_ids, out.num_emitted, out.logprobs]
        if out.token_ids.device.type != "cuda":
            self._host = tuple(tensors)
            return
        host = []
        for t in tensors:
            if t is None:
                host.append(None)
                continue
            pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            pinned.copy_(t, non_blocking=True)
            host.append(pinned)
        self._host = tuple(host)
        self._event = torch.cuda.Event()
        self._event.record()

    def set_sampled(self, out: SampledRows, plan: SamplingPlan) -> None:
        """Keep the step's sampled ids on the device and queue their copy to pinned host
        memory (one copy, a second only when some row asked for logprobs) and an event."""
        self.token_ids, self.plan = out.token_ids, plan
        if out.token_ids.device.type != "cuda":
            self._host = (out.token_ids, out.logprobs)
            return
        ids = torch.empty(out.token_ids.shape, dtype=torch.int64, pin_memory=True)
        ids.copy_(out.token_ids, non_blocking=True)
        packed = None
        if out.logprobs is not None:
            packed = torch.empty(out.logprobs.shape, dtype=torch.float32, pin_memory=True)
            packed.copy_(out.logprobs, non_blocking=True)
        self._host = (ids, packed)
        self._event = torch.cuda.Event()
        self._event.record()

    def result(self) -> list[SampledToken | list[SampledToken] | None]:
        if self._results is not None:
            return self._results
        if self.finish is not None:
            finish, self.finish = self.finish, None
            try:
                finish()
            except BaseException:
                if self.replay is not None:
                    self.replay.release()  # its forward ran long ago: its logits arrived
                raise
        if self._event is not None:
            self._event.synchronize()
        if self.replay is not None:
            self.replay.release()  # the step has read its staging buffers
        results: list = [None] * len(self.batch.items)
        if isinstance(self.plan, VerifyPlan):
            ids, counts, packed = self._host
            out = verified_output(
                ids.tolist(), counts.tolist(), None if packed is None else packed.tolist(),
                self.plan,
            )  # fmt: skip
            lps, tops = out.logprobs, out.top_logprobs
            for i, row in enumerate(self.sample_rows):
                if lps is None:  # no row asked for logprobs (the common case)
                    results[row] = [SampledToken(token) for token in out.token_ids[i]]
                    continue
                results[row] = [
                    SampledToken(
                        token,
                        None if lps is None or lps[i] is None else lps[i][m],
                        None if tops is None or tops[i] is None else tops[i][m],
                    )
                    for m, token in enumerate(out.token_ids[i])
                ]
        elif self._host is not None:
            ids, packed = self._host
            out = host_output(ids.tolist(), None if packed is None else packed.tolist(), self.plan)
            for i, row in enumerate(self.sample_rows):
                results[row] = SampledToken(
                    out.token_ids[i],
                    None if out.logprobs is None else out.logprobs[i],
                    None if out.top_logprobs is None else out.top_logprobs[i],
                )
        self._results = results
        return results
