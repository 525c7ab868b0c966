"""Start-up warm-up of the sampled path, run by rank 0's `Worker` before the node reports ready.

Triton compiles a kernel the first time it meets a specialization (each pointer's 16-byte
alignment, each integer argument's divisibility by 16 or equality to 1, each constexpr) and
keeps the binary in its disk cache. The forwards are compiled when their CUDA graphs are
captured, but sampling runs outside the graphs: in a fresh container the first sampled requests
compiled the sampler's kernels inside decode steps, stalling the whole batch (issue 25: 11.9 ms
per step in a fresh machine's first process, 4.8 ms in the next). `warm_up` runs one step's
sampling, through the runner's own code (`ModelRunner._sample`, `StepHandle.result`), on dummy
logits of the real vocabulary for:

- one row of each kind in `KINDS` alone (a single sampled row passes top-p as a strided view of
  the plan's filters, an unaligned pointer: its own Triton specialization), then each batch
  size (default: the decode graphs' sizes and small prefill row counts) with a mix of kinds;
- with xgrammar and the model's tokenizer, a JSON-schema grammar row (the grammar compiler and
  the bitmask kernel, whose row count is specialized: 1, 2 and 16 rows);
- with speculation, the verify step (`Sampler.plan_verify` / `verify`) over drafted rows.

On CPU nothing compiles (torch's CPU kernels are built ahead of time; the Triton kernels run
on CUDA only), so by default nothing runs there; tests pass `sizes`.
Every dummy request's sampler and grammar state is released; what stays is what any request
would leave: the token-count table's first rows, the compiled grammar compiler and pinned
host blocks.

Not covered (still compiled or set up on first use): each new grammar (xgrammar compiles a
schema on the host), torch kernels chosen by shapes not run here (a `top_k` far from 40-50),
and forwards outside the captured graphs: eager or piecewise prefill steps, whose attention
kernels specialize on their shapes, and every step under `--enforce-eager`. On Hopper their
kernels are also other binaries than the captured ones, which launch with PDL
(`common/model/kernels/pdl.py`): a first prompt longer than `--prefill-graph-max-tokens`
compiles its eager variants (Triton's disk cache keeps them for later processes).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.engine.cuda_graphs import capture_sizes
from common.engine.scheduler import ScheduledBatch, ScheduledSeq
from common.engine.sequence import Sequence
from common.engine.step_handle import StepHandle
from common.protocol.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from common.engine.model_runner import ModelRunner
    from common.engine.worker import Worker

log = logging.getLogger(__name__)

PROMPT = (1, 2, 3, 4)  # dummy token ids (modulo the vocabulary)
OUTPUT = (5, 6)  # already sampled: penalties count them, the draw index is 2
PREFILL_ROWS = (2, 3)  # a prefill step samples one row per prompt it ends: a few
GRAMMAR_ROWS = (2, 16)  # the bitmask kernel's row count: 1 (in the mix), other, 16 | n
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
STRUCTURED = {"type": "json_schema", "schema": json.dumps(SCHEMA)}

KINDS = (
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=40),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.8, top_p=0.95, top_k=50, min_p=0.02, seed=7),
    SamplingParams(
        temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1
    ),
    SamplingParams(temperature=0, repetition_penalty=1.2),
    SamplingParams(temperature=0, logprobs=0),
    SamplingParams(temperature=0.8, top_p=0.9, logprobs=MAX_LOGPROBS),
    SamplingParams(temperature=0, logit_bias=[(1, 5.0), (2, -5.0)]),
    SamplingParams(temperature=0.8, min_tokens=len(OUTPUT) + 4),
)
GRAMMAR = SamplingParams(temperature=0.8, structured=STRUCTURED)
# Rows of a large size past one of each kind: no penalties, so the token-count table keeps
# its first 8 rows, as a few penalised requests would leave it.
FILLER = tuple(k for k in KINDS if not k.uses_penalties)


@dataclass(frozen=True)
class WarmupReport:
    passes: int  # sampling steps run
    rows: list[int]  # their row counts
    grammar: bool
    verify: bool
    seconds: float


def warm_up(
    worker: Worker, sizes: Seq[int] | None = None, grammar: bool | None = None
) -> WarmupReport:
    """Run every sampling variant a request can reach on rank 0's runner (module docstring).
    `sizes`: batch sizes of the mixed steps (default: on CUDA the decode graphs' sizes and
    `PREFILL_ROWS`; on CPU none, since nothing compiles there and a pass over a real
    vocabulary costs tenths of a second). `grammar`: warm the grammar path too, when
    xgrammar is importable and the model has a tokenizer (default: on CUDA)."""
    cuda = worker.device.type == "cuda"
    if sizes is None:
        sizes = _decode_sizes(worker) if cuda else ()
    if any(type(n) is not int or n < 1 for n in sizes):
        raise ValueError(f"warm-up sizes must be positive integers, got {sizes!r}")
    if not sizes:
        log.debug("warm-up: nothing to warm on %s", worker.device)
        return WarmupReport(0, [], False, False, 0.0)
    grammar = (cuda if grammar is None else grammar) and _grammar_available(worker)
    kinds = (*KINDS, GRAMMAR) if grammar else KINDS
    steps = [[k] for k in kinds] if cuda else []
    steps += [_mix(kinds, n) for n in sizes]
    if grammar:
        steps += [[GRAMMAR] * n for n in GRAMMAR_ROWS]
    sc = worker.config.speculative
    verify: list[int] = []
    if sc.enabled:  # a speculating step has at most speculative_max_batch sequences
        most = min(worker.config.scheduler.max_num_seqs, sc.speculative_max_batch)
        verify = sorted({min(n, most) for n in sizes})
    start = time.perf_counter()
    rows = [_step(worker.runner, params) for params in steps]
    rows += [_step(worker.runner, _mix(kinds, n), sc.num_speculative_tokens) for n in verify]
    if cuda:
        torch.cuda.empty_cache()  # the steps' temporaries: the KV pool was sized without them
    report = WarmupReport(len(rows), rows, grammar, bool(verify), time.perf_counter() - start)
    log.info(
        "warm-up: %d sampling steps of %d to %d rows%s%s in %.2f s",
        report.passes, min(rows), max(rows), ", grammar masks" if grammar else "",
        ", verify" if verify else "", report.seconds,
    )  # fmt: skip
    return report


def _decode_sizes(worker: Worker) -> list[int]:
    """The decode graphs' batch sizes (the sizes they would have when not captured) and a few
    prefill row counts."""
    graphs = worker.runner.graphs
    decode = graphs.sizes if graphs else capture_sizes(worker.config.scheduler.max_num_seqs)
    return sorted({*decode, *PREFILL_ROWS})


def _mix(kinds: Seq[SamplingParams], n: int) -> list[SamplingParams]:
    """n rows: each kind once, then the filler kinds in turn."""
    return [kinds[i] if i < len(kinds) else FILLER[i % len(FILLER)] for i in range(n)]


def _grammar_available(worker: Worker) -> bool:
    if importlib.util.find_spec("xgrammar") is None:
        return False
    if worker.tokenizer is None:
        log.info("warm-up: no tokenizer in %s, grammar masks not warmed", worker.source.directory)
        return False
    return True


def _step(runner: ModelRunner, params: list[SamplingParams], num_drafts: int = 0) -> int:
    """Sample one step of `params` rows (each verifying `num_drafts` drafts, every third none)
    exactly as a launched step does, read it back, and release the rows' state. Returns the
    number of logits rows."""
    vocab = runner.sampler.vocab_size
    eos = frozenset(runner.eos_token_ids)
    seqs = [
        Sequence(
            f"\0warmup-{i}",
            [t % vocab for t in PROMPT],
            p,
            eos,
            # A grammar's matcher would replay the output, which the grammar refuses.
            output_token_ids=[] if p.structured else [t % vocab for t in OUTPUT],
        )
        for i, p in enumerate(params)
    ]
    drafts = [
        [(7 + i + j) % vocab for j in range(num_drafts if i % 3 != 2 else 0)]
        for i in range(len(seqs))
    ]
    batch = ScheduledBatch(
        [ScheduledSeq(s, s.num_tokens - 1, 1) for s in seqs], drafts=drafts if num_drafts else []
    )
    rows = len(seqs) + sum(map(len, batch.drafts))
    logits = _logits(runner, rows)
    handle = StepHandle(batch, list(range(len(seqs))))
    try:
        with torch.inference_mode():
            # The call `ModelRunner.launch` makes once a step's logits exist: grammar masks and
            # logit_bias, the plan, sampling or verification, and the copy to the host.
            runner._sample(handle, batch, logits)
        handle.result()
    finally:
        for seq in seqs:
            runner.release(seq.request_id)
    return rows


def _logits(runner: ModelRunner, rows: int) -> torch.Tensor:
    """[rows, V] float32 dummy logits, the same in every row (no RNG is drawn): the decode
    graphs' shared logits buffer, which decode steps sample from and nothing reads before the
    first step, or a new tensor when it is too small."""
    vocab, device = runner.sampler.vocab_size, runner.device
    graphs = runner.graphs
    if graphs is not None and graphs.logits.shape[0] >= rows and graphs.logits.shape[1] == vocab:
        logits = graphs.logits[:rows]
    else:
        logits = torch.empty(rows, vocab, dtype=torch.float32, device=device)
    row = (runner.sampler.salts % 4096).to(torch.float32) / 512.0  # spread over [0, 8)
    return logits.copy_(row.expand(rows, vocab))
