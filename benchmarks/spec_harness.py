"""The harness of `benchmarks/bench_spec.py`: one target model (the first engine's worker) shared
by every engine a run builds (off, overlapped or not; speculating with K; draft; EAGLE-3), and
the two ways it runs requests: a steady batch (median step time) and waves of whole requests
joining and leaving (output tok/s).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.roofline import matmul_params, weight_bytes
from benchmarks.spec_oracle import TimedProposer
from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sequence import Sequence
from common.engine.spec_decode.stats import SpecStats
from common.protocol.sampling_params import SamplingParams


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def spec_totals(seqs: list[Sequence]) -> SpecStats:
    total = SpecStats()
    for seq in seqs:
        total.add(seq.spec)
    return total


def finish(engine: LLMEngine, seqs: list[Sequence]) -> None:
    """Abort what still runs and resolve the step in flight: the engine holds nothing."""
    for seq in seqs:
        if not seq.is_finished:
            engine.abort(seq.request_id)
    while engine.has_unfinished():
        engine.step()


@contextlib.contextmanager
def context_free(model: torch.nn.Module) -> Iterator[None]:
    """Zero every layer's o_proj and down_proj (restored after): each layer still runs all its
    matmuls and attention, but adds nothing to the residual stream, so the logits depend on the
    current token only and greedy output is stable under bf16 reordering."""
    saved = []
    with torch.no_grad():
        for layer in model.model.layers:
            for weight in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
                saved.append((weight, weight.clone()))
                weight.zero_()
    try:
        yield
    finally:
        with torch.no_grad():
            for weight, copy in saved:
                weight.copy_(copy)


class Bench:
    """One target model (the first engine's worker) and the engines that share it."""

    def __init__(self, args: argparse.Namespace, spec_models: dict[str, Path]) -> None:
        self.args = args
        self.spec_models = spec_models
        self.start = time.monotonic()
        parts = set(args.parts)
        batches = [
            *(args.oracle_batches if "oracle" in parts else ()),
            *(args.sweep_batches if "sweep" in parts else ()),
            *(args.verify_batches if "verify" in parts else ()),
            *(args.method_batches if parts & {"draft", "eagle3"} else ()),
        ]
        self.max_batch = max(batches, default=1)
        ks = [
            args.k,
            *(args.verify_ks if "verify" in parts else ()),
            *(args.sweep_ks if "sweep" in parts else ()),
        ]
        self.max_k = max(ks)
        self.options = dict(
            model=args.model,
            load_format="dummy",
            dtype=args.dtype,
            device=args.device,
            max_num_seqs=self.max_batch,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=False,  # every run computes its prompts
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            speculative_max_batch=self.max_batch,
        )
        # The worker is built with the widest speculative config (its decode graphs hold
        # max_batch x (K + 1) rows) and loads the draft model or EAGLE-3 head, if any (the
        # one proposer every engine of that method shares; EAGLE-3 turns the target's aux
        # outputs on).
        method = next(iter(spec_models), "ngram")
        self.engines: dict[tuple[str, int, bool], LLMEngine] = {}
        self.observers: dict[int, Any] = {}  # id(engine) -> the runner's aux observer for it
        first = LLMEngine(self._config(method, self.max_k, overlap=False))
        self.worker = first.worker
        self.cuda = self.worker.device.type == "cuda"
        self._register((method, self.max_k, False), first)
        self.vocab = self.worker.runtime.vocab_size
        self.off_runs: dict[int, dict[str, dict[str, Any]]] = {}  # batch -> weights -> run
        self.warmed: set[tuple] = set()
        self.weights_state = "as-is"
        self.info = self._info()

    def _config(self, method: str, k: int, overlap: bool) -> EngineConfig:
        options = {**self.options, "overlap_scheduling": overlap, "speculative_method": method}
        if method != "none":
            options["num_speculative_tokens"] = k
        if method in ("draft", "eagle3"):
            options["speculative_model"] = str(self.spec_models[method])
        return EngineConfig.from_options(**options)

    def _register(self, key: tuple[str, int, bool], engine: LLMEngine) -> None:
        if key[0] in ("draft", "eagle3"):
            engine.core.proposer = TimedProposer(engine.core.proposer, self.cuda)
        # Building an EAGLE-3 engine points the shared runner at the head's `observe`; the
        # other engines run without it (`use`), as a worker without a head would.
        self.observers[id(engine)] = self.worker.runner.aux_observer if key[0] == "eagle3" else None
        self.engines[key] = engine

    def use(self, engine: LLMEngine) -> LLMEngine:
        """`engine`, with the runner's aux observer set for it."""
        self.worker.runner.aux_observer = self.observers[id(engine)]
        return engine

    def engine(self, method: str = "none", k: int = 0, overlap: bool = False) -> LLMEngine:
        key = (method, k, overlap)
        if key not in self.engines:
            self._register(key, LLMEngine(self._config(method, k, overlap), self.worker))
        return self.engines[key]

    def over_budget(self) -> bool:
        budget = self.args.budget_s
        return bool(budget) and time.monotonic() - self.start > budget

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def prompts(self, n: int, length: int, seed: int) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        return rng.integers(100, self.vocab - 100, (n, length)).tolist()

    def _info(self) -> dict[str, Any]:
        w, rt = self.worker, self.worker.runtime
        return {
            "model": Path(self.args.model).name,
            "dtype": rt.dtype,
            "backend": rt.attention_backend,
            "weight_bytes": weight_bytes(w.model),
            "kv_bytes_per_token": w.spec.kv_bytes_per_token(w.kv_cache.pool.element_size()),
            "num_kv_blocks": rt.num_kv_blocks,
            "decode_graph_sizes": list(rt.cuda_graph_sizes),
            "prefill_graph_buckets": list(rt.prefill_graph_buckets),
            "speculative_method": w.config.speculative.speculative_method,
            # EAGLE-3: the target keeps these layers' inputs in every forward, also in the
            # engines that do not draft (their steps pay for it; the observer is off)
            "aux_hidden_layers": list(getattr(w.model.model, "aux_hidden_layers", ())),
        }

    # -- the two ways of running requests ---------------------------------------------------
    def steady(self, engine: LLMEngine, batch: int, k: int, tag: str) -> dict[str, Any]:
        """Median wall time of one `engine.step()` with `batch` requests decoding (prompts of
        --context tokens, none finishing while timed)."""
        a = self.args
        self.use(engine)
        max_tokens = (a.warmup + a.steps + 4) * (k + 1) + 8
        seqs = [
            engine.add_request(f"{tag}-{i}", prompt, greedy(max_tokens))
            for i, prompt in enumerate(self.prompts(batch, a.context, seed=batch))
        ]
        while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in seqs):
            engine.step()
        for _ in range(a.warmup):
            engine.step()
        timed = getattr(engine.core.proposer, "times", None)
        if timed is not None:
            timed.clear()
        times, emitted, context = [], 0, 0.0
        for _ in range(a.steps):
            begin = time.perf_counter()
            events = engine.step()
            times.append(time.perf_counter() - begin)
            emitted += sum(len(e.new_token_ids) for e in events)
            context += sum(s.num_tokens for s in seqs) / batch
        stats = spec_totals(seqs)
        finish(engine, seqs)
        return {
            "step_s": statistics.median(times),
            "tokens_per_step": emitted / a.steps / batch,
            "mean_context": context / a.steps,
            "propose_s": statistics.median(timed) if timed else None,
            "mean_accepted_length": stats.mean_accepted_length if stats.num_drafts else None,
        }

    def waves(
        self, engine: LLMEngine, prompts: list[list[int]], lengths: list[int], batch: int, tag: str
    ) -> dict[str, Any]:
        """Greedy requests, at most `batch` at a time, the next joining as one ends: output
        tok/s over the whole run (prefills included)."""
        queue, seqs = deque(range(len(prompts))), []
        self.use(engine)
        self.sync()
        begin = time.perf_counter()
        while queue or engine.has_unfinished():
            live = sum(not s.is_finished for s in seqs)
            while queue and live < batch:
                i = queue.popleft()
                seqs.append(engine.add_request(f"{tag}-{i}", prompts[i], greedy(lengths[i])))
                live += 1
            engine.step()
        self.sync()
        elapsed = time.perf_counter() - begin
        outputs = [list(s.output_token_ids) for s in seqs]
        tokens = sum(len(o) for o in outputs)
        assert tokens == sum(lengths), f"{tokens} tokens for max_tokens summing to {sum(lengths)}"
        stats = spec_totals(seqs)
        return {
            "requests": len(seqs),
            "output_tokens": tokens,
            "time_s": elapsed,
            "tokens_per_s": tokens / elapsed,
            "outputs": outputs,
            "spec": stats.to_dict() if stats.num_drafts else None,
        }

    def workload(self, batch: int) -> tuple[list[list[int]], list[int]]:
        a = self.args
        n = max(batch * a.waves, a.min_requests)
        lengths = np.random.default_rng(batch + 1).integers(*a.output_range, n, endpoint=True)
        return self.prompts(n, a.prompt_len, seed=1000 + batch), lengths.tolist()

    def warm(self, engine: LLMEngine, batch: int, proposer: Any = None) -> None:
        """Once per engine and batch: a short run of the workload's shapes (batch + 1 prompts
        of --prompt-len, one joining mid-run, 8 tokens each), so no compile or first-use cost
        lands in a timed run."""
        key = (id(engine), batch)
        if key in self.warmed:
            return
        own = engine.core.proposer
        if proposer is not None:
            engine.core.proposer = proposer
        prompts = self.prompts(batch + 1, self.args.prompt_len, seed=5)
        self.waves(engine, prompts, [8] * (batch + 1), batch, f"warm{len(self.warmed)}")
        engine.core.proposer = own
        self.warmed.add(key)

    def off_run(self, batch: int, reference: bool = False) -> dict[str, Any]:
        """Speculation off, the overlapped loop, on `workload(batch)`: the baseline (any run
        at `batch` will do: the weights' values do not change the time) or, with `reference`,
        the oracle's reference (a run under the current weights)."""
        runs = self.off_runs.setdefault(batch, {})
        run = runs.get(self.weights_state) if reference else next(iter(runs.values()), None)
        if run is None:
            engine = self.engine("none", 0, overlap=True)
            self.warm(engine, batch)
            tag = f"off{batch}{self.weights_state}"
            run = self.waves(engine, *self.workload(batch), batch, tag)
            run["weights"] = self.weights_state
            runs[self.weights_state] = run
            print(
                f"off b{batch} ({self.weights_state}): {run['tokens_per_s']:.1f} tok/s", flush=True
            )
        return run

    def floor_s(self, rows: int, batch: int, context: float, ceil: dict | None) -> float | None:
        """max(weights + every sequence's KV once at the copy rate, the rows' matmuls (LM head
        included) at the bf16 rate); attention FLOPs left out."""
        if ceil is None:
            return None
        info, spec = self.info, self.worker.spec
        high, fp8 = matmul_params(self.worker.model)
        flops = 2 * rows * (high + fp8 + spec.vocab_size * spec.hidden_size)
        read = info["weight_bytes"] + batch * context * info["kv_bytes_per_token"]
        return max(read / ceil["copy_bytes_per_s"], flops / ceil["bf16_flops_per_s"])

    @contextlib.contextmanager
    def oracle_weights(self) -> Iterator[None]:
        """The weights the oracle runs under: --oracle-model context-free or as-is."""
        if self.args.oracle_model == "as-is":
            yield
            return
        with context_free(self.worker.model):
            self.weights_state = "context-free"
            try:
                yield
            finally:
                self.weights_state = "as-is"

    def catchup(self, engine: LLMEngine, tag: str) -> dict[str, Any]:
        """Per request of --catchup-prompt tokens (the first one a warm-up): the target's prefill
        step, then the first propose (the proposer computes the prompt for itself) against
        the next ones; medians."""
        a, proposer = self.args, self.use(engine).core.proposer
        prefill, first, later = [], [], []
        for i, prompt in enumerate(self.prompts(a.catchup_requests + 1, a.catchup_prompt, 7)):
            seq = engine.add_request(f"{tag}-cu{i}", prompt, greedy(8 * (a.k + 1)))
            self.sync()
            begin = time.perf_counter()
            engine.step()
            self.sync()
            elapsed = time.perf_counter() - begin
            proposer.times.clear()
            for _ in range(4):
                engine.step()
            finish(engine, [seq])
            if i and len(proposer.times) > 1:
                prefill.append(elapsed)
                first.append(proposer.times[0])
                later.append(statistics.median(proposer.times[1:]))
        if not first:
            raise RuntimeError(f"{tag}: no request drafted twice after its prefill")
        return {
            "method": tag,
            "prompt_tokens": a.catchup_prompt,
            "target_prefill_s": statistics.median(prefill),
            "first_propose_s": statistics.median(first),
            "later_propose_s": statistics.median(later),
        }

    def reset(self) -> None:
        """After a failed part: abort every request of every engine, resolve what is in flight."""
        for engine in self.engines.values():
            self.use(engine)
            for rid in list(engine.sequences):
                engine.abort(rid)
            while engine.has_unfinished():
                engine.step()
