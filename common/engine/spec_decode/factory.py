"""The decoding engine's speculative parts, built from `EngineConfig.speculative`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.engine.block_allocator import BlockAllocator
from common.engine.config import EngineConfig
from common.engine.scheduler import Scheduler
from common.engine.spec_decode.ngram import NgramProposer
from common.engine.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from common.engine.worker import Worker


def decoding_scheduler(config: EngineConfig, allocator: BlockAllocator) -> Scheduler:
    """A decode (or colocated, or offline) scheduler; it reserves blocks for drafts when
    speculation is on."""
    sc = config.speculative
    if not sc.enabled:
        return Scheduler(config.scheduler, allocator)
    return Scheduler(
        config.scheduler,
        allocator,
        num_speculative_tokens=sc.num_speculative_tokens,
        speculative_max_batch=sc.speculative_max_batch,
    )


def build_proposer(config: EngineConfig, worker: Worker) -> Proposer | None:
    """The proposer of `config.speculative.speculative_method`, None when speculation is off."""
    sc = config.speculative
    if sc.speculative_method == "none":
        return None
    if sc.speculative_method == "ngram":
        return NgramProposer(sc.speculative_ngram_min, sc.speculative_ngram_max)
    if worker.proposer is None:
        raise ValueError(
            f"speculative_method={sc.speculative_method}: this worker was built without its "
            "proposer (Worker(drafts=False))"
        )
    if sc.speculative_method == "eagle3":
        worker.runner.aux_observer = worker.proposer.observe
    return worker.proposer
