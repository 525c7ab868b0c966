"""Shared pieces of the scheduler tests: a real Scheduler and BlockAllocator driven by a
fake model loop (no torch)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from common.engine.block_allocator import BlockAllocator
from common.engine.config import SchedulerConfig
from common.engine.scheduler import SampledToken, ScheduledBatch, Scheduler
from common.engine.sequence import Sequence
from common.protocol.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[1]
EOS = 2
FILLER = 7  # a token that never stops anything

TokenChooser = Callable[[Sequence], int]


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 16,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 256,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    return Scheduler(config, BlockAllocator(num_blocks, block_size, enable_prefix_caching))


def make_seq(
    request_id: str,
    prompt: int | list[int],
    max_model_len: int = 1 << 30,
    **params: object,
) -> Sequence:
    """`prompt` is a token list, or a length for a prompt unique to this request."""
    if isinstance(prompt, int):
        base = 1000 * (1 + sum(map(ord, request_id)))
        prompt = [base + i for i in range(prompt)]
    params.setdefault("max_tokens", 4)
    return Sequence(
        request_id,
        prompt,
        SamplingParams(**params),  # type: ignore[arg-type]
        eos_token_ids=frozenset({EOS}),
        max_model_len=max_model_len,
    )


def always(token: int) -> TokenChooser:
    return lambda seq: token


def filler(seq: Sequence) -> int:
    return FILLER


def step(
    scheduler: Scheduler, choose: TokenChooser = filler
) -> tuple[ScheduledBatch, list[Sequence]]:
    """One engine step; returns the batch and the sequences that finished in it."""
    batch = scheduler.schedule()
    sampled = [SampledToken(choose(item.seq)) if item.samples else None for item in batch.items]
    return batch, scheduler.update(batch, sampled)


def run_until_idle(
    scheduler: Scheduler, choose: TokenChooser = filler, max_steps: int = 1000
) -> list[ScheduledBatch]:
    batches = []
    for _ in range(max_steps):
        if not scheduler.has_work():
            return batches
        batch, _ = step(scheduler, choose)
        assert batch or batch.preempted, "scheduler has work but scheduled nothing"
        batches.append(batch)
    raise AssertionError(f"still busy after {max_steps} steps")


def rows(batch: ScheduledBatch) -> list[tuple[str, int, int]]:
    return [(item.seq.request_id, item.start, item.num_new_tokens) for item in batch.items]
