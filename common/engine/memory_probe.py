"""GPU memory probes, run before the KV pool is sized: one eager step on a scratch pool."""

from __future__ import annotations

import torch

from common.engine.kv_cache import KVCache
from common.engine.model_runner import ModelRunner
from common.engine.scheduler import ScheduledBatch, ScheduledSeq
from common.engine.sequence import Sequence
from common.model.attention import AttentionBackend
from common.model.registry import CausalLM
from common.protocol.sampling_params import SamplingParams


def step_peak_bytes(
    model: CausalLM,
    backend: AttentionBackend,
    block_size: int,
    prompt_lengths: list[int],
    kv_dtype: torch.dtype | None = None,
) -> int:
    """Peak memory, above what was allocated before, of one eager step that prefills one
    sequence per length (each on its own scratch blocks, in `kv_dtype`, default the model's:
    an FP8 pool runs the FP8 kernels). Leaves the device's peak statistic at that step's peak
    (`gpu_kv_budget` reads it)."""
    device, dtype = model.device, model.dtype
    blocks = [-(-n // block_size) for n in prompt_lengths]
    scratch = KVCache.allocate(
        model.spec, sum(blocks), block_size, kv_dtype or dtype, device, layers=model.stage.layers
    )
    runner = ModelRunner(model, scratch, backend, device)
    batch, first = ScheduledBatch(), 0
    for i, (n, count) in enumerate(zip(prompt_lengths, blocks, strict=True)):
        seq = Sequence(f"probe-{i}", [0] * n, SamplingParams(max_tokens=1))
        seq.block_ids = list(range(first, first + count))
        first += count
        batch.items.append(ScheduledSeq(seq, 0, n))
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.execute(batch)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del scratch, runner
    torch.cuda.empty_cache()
    return peak


def graph_margin(step_bytes: int) -> int:
    """What captured graphs hold for a step of `step_bytes` peak: the step plus a margin."""
    return step_bytes + step_bytes // 4 + (64 << 20)
