"""What a proposer is: it drafts tokens for the decode items of a scheduled batch.

Called by `EngineCore` after `Scheduler.schedule` and before the runner launches the step, with
every token of each sequence on the host (speculation runs the synchronous loop). `limits[i]` is
how many tokens item i may draft (0: it does not speculate this step: a prompt chunk, a sequence
near max_tokens or the context limit, or a step too large to speculate); the scheduler has
already given the sequence blocks for its last token plus `limits[i]` drafts. A proposer may
draft fewer, or none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from common.engine.scheduler import ScheduledBatch


@dataclass
class Drafts:
    # Per batch item, the drafted tokens that continue `seq.all_token_ids` ([]: none).
    token_ids: list[list[int]]
    # [sum of the drafts' lengths, V] float32: the draft distribution each token was sampled
    # from, rows in item order; None when the proposals are deterministic (n-gram lookup, a
    # draft model's argmax), which the rejection sampler treats as one-hot.
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    method: str

    def propose(self, batch: ScheduledBatch, limits: list[int]) -> Drafts: ...

    def release(self, request_id: str) -> None:
        """Forget a request's state once it has ended."""
        ...
