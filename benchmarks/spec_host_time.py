"""Host (Python) time of one speculative engine step, per part, on CPU.

A tiny random Qwen2 (float32, CPU) so the device part is small; the decode-graph code path
(staging ring, replayed eagerly on CPU); the oracle proposer of `benchmarks/spec_oracle.py`
drafting K tokens of a reference run (mostly accepted); steady state (requests already
decoding). Each part's wall time (the median over the timed steps) is measured around the engine's own functions (inclusive:
indented parts are inside the part above them); `model` is the tiny model's forward, which on a
GPU is a graph replay, and `host` is `step` without it. The sampler's torch ops run on the CPU
here; on a GPU they are kernel launches of about the same host cost.

    python benchmarks/spec_host_time.py --batches 1 8 32 --k 4
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from benchmarks.spec_oracle import OracleProposer
from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.step_handle import StepHandle
from common.protocol.sampling_params import SamplingParams
from tests.tiny_models import TINY_SHAPE

# (label, depth): the table's rows, in order; depth is the nesting shown.
PARTS = [
    ("step", 0),
    ("schedule", 1),
    ("propose", 1),
    ("launch", 1),
    ("host_inputs", 2),
    ("forward", 2),
    ("model", 3),
    ("sample", 2),
    ("logits_processors", 3),
    ("plan_verify", 3),
    ("verify", 3),
    ("commit", 1),
    ("resolve_step", 1),
    ("result", 2),
    ("scheduler.resolve", 2),
    ("new_tokens", 0),
]


class PartTimer:
    """Wraps named callables so that each call adds its wall time to its label."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.on = False
        self._wrapped: list[tuple[Any, str]] = []

    def wrap(self, owner: Any, name: str, label: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)
        totals = self.totals

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return inner(*args, **kwargs)
            begin = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - begin

        self._wrapped.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, timed)

    def restore(self) -> None:
        """Put back what each wrapper replaced (a class's function, or nothing over it)."""
        for owner, name, own in reversed(self._wrapped):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        self._wrapped = []


def save_model(folder: str, vocab: int, context: int) -> str:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        **TINY_SHAPE,
        max_position_embeddings=context,
        tie_word_embeddings=False,
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def build(folder: str, args: argparse.Namespace) -> tuple[LLMEngine, LLMEngine]:
    """(the speculating engine, one without speculation on the same worker)."""
    options = dict(
        model=folder,
        device="cpu",
        dtype="float32",
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=max(args.batches) * args.prompt_len,
        enable_prefix_caching=False,
        speculative_method="ngram",  # replaced by the oracle below
        num_speculative_tokens=args.k,
        speculative_max_batch=max(args.batches),
    )
    engine = LLMEngine(EngineConfig.from_options(**options))
    worker = engine.worker
    worker.runner.capture_graphs(worker._decode_graph_rows(), engine.runtime.max_model_len)
    plain = {k: v for k, v in options.items() if "speculative" not in k}
    return engine, LLMEngine(EngineConfig.from_options(**plain), worker)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def reference(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of `engine` (speculation off): the oracle's truth."""
    seqs = [engine.add_request(f"ref{i}", p, greedy(max_tokens)) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [list(s.output_token_ids) for s in seqs]


def instrument(engine: LLMEngine, timer: PartTimer) -> None:
    core, runner = engine.core, engine.worker.runner
    timer.wrap(core, "step", "step")
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "commit", "commit")
    timer.wrap(engine.scheduler, "resolve", "scheduler.resolve")
    timer.wrap(core, "_resolve", "resolve_step")
    timer.wrap(runner, "launch", "launch")
    timer.wrap(runner, "host_inputs", "host_inputs")
    timer.wrap(runner, "_forward", "forward")
    timer.wrap(runner.graphs, "_forward", "model")
    timer.wrap(runner, "_sample", "sample")
    timer.wrap(runner.logits_processors, "apply_drafts", "logits_processors")
    timer.wrap(runner.sampler, "plan_verify", "plan_verify")
    timer.wrap(runner.sampler, "verify", "verify")
    timer.wrap(core.proposer, "propose", "propose")
    timer.wrap(StepHandle, "result", "result")


def measure(
    engine: LLMEngine,
    plain: LLMEngine,
    args: argparse.Namespace,
    batch: int,
    profile: cProfile.Profile | None = None,
) -> dict[str, float]:
    """Per-step microseconds of each part at `batch` requests decoding; `profile` (if any)
    runs during the timed steps."""
    rng = np.random.default_rng(batch)
    vocab = engine.runtime.vocab_size
    prompts = rng.integers(3, vocab, (batch, args.prompt_len)).tolist()
    max_tokens = (args.warmup + args.steps + 2) * (args.k + 1) + 8
    refs = reference(plain, prompts, max_tokens)
    oracle = OracleProposer({}, args.mean_accepted_length, args.k, vocab, seed=batch)
    engine.core.proposer = oracle
    seqs = []
    for i, (prompt, ref) in enumerate(zip(prompts, refs, strict=True)):
        rid = f"b{batch}-{i}"
        oracle.references[rid] = ref
        seqs.append(engine.add_request(rid, prompt, greedy(max_tokens)))
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in seqs):
        engine.step()
    for _ in range(args.warmup):
        engine.step()
    timer = PartTimer()
    instrument(engine, timer)
    emitted = 0
    per_step: dict[str, list[float]] = defaultdict(list)
    timer.on = True
    for _ in range(args.steps):
        timer.totals.clear()
        if profile is not None:
            profile.enable()
        outputs = engine.core.step()
        if profile is not None:
            profile.disable()
        begin = time.perf_counter()
        for out in outputs:
            emitted += len(out.new_tokens())
        timer.totals["new_tokens"] += time.perf_counter() - begin
        timer.totals["host"] = timer.totals["step"] - timer.totals["model"]
        for label in [*(label for label, _ in PARTS), "host"]:
            per_step[label].append(timer.totals[label])
    timer.on = False
    timer.restore()
    assert not any(s.is_finished for s in seqs), "a request finished while timed"
    for seq in seqs:
        engine.abort(seq.request_id)
    while engine.has_unfinished():
        engine.step()
    # Medians: the machine is shared, a mean takes in every other process's bursts.
    us = {label: statistics.median(times) * 1e6 for label, times in per_step.items()}
    us["tokens_per_seq_step"] = emitted / args.steps / batch
    return us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--mean-accepted-length", type=float, default=3.5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="print this many functions of the largest batch's timed steps by own time (cProfile)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    context = args.prompt_len + (args.warmup + args.steps + 4) * (args.k + 1) + 16
    with tempfile.TemporaryDirectory() as folder:
        engine, plain = build(save_model(folder, args.vocab, context), args)
        profile = cProfile.Profile() if args.profile else None
        largest = max(args.batches)
        results = {
            b: measure(engine, plain, args, b, profile if b == largest else None)
            for b in args.batches
        }
    header = f"{'part (us per step)':<24}" + "".join(f"{'b' + str(b):>10}" for b in results)
    print(header)
    for label, depth in [*PARTS, ("host", 0), ("tokens_per_seq_step", 0)]:
        name = "  " * depth + label
        cells = "".join(f"{results[b][label]:>10.1f}" for b in results)
        print(f"{name:<24}{cells}")
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
