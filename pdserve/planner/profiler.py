"""Measure one device's engine: the real step (`EngineCore.step`: scheduler, model runner,
sampler, with CUDA graphs where the nodes use them), not a bare forward pass.

- Prefill: one prompt of T tokens in one step of a prefill-only scheduler (as the prefill
  node runs it), and T new tokens after C cached ones (the prefix cache supplies the context:
  a chunk late in a long prompt).
- Decode: B sequences of C tokens each, decoded by the scheduler and loop the decode node
  uses (overlapped unless the flags turn it off); the mean of several steady steps.
- KV: bytes per token from the model shapes and the pool's dtype, the pool the worker sized at
  the configured memory fraction, and the device's total memory.
- Experts (MoE models): the routed experts this rank holds and their bytes (`ExpertLoad`), so
  the decode fit gets a term for the experts a batch touches.
Every prompt has fresh random ids, so no measurement hits the prefix cache by accident.
"""

from __future__ import annotations

import dataclasses
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

import torch

from common.engine.config import EngineConfig
from common.engine.core import EngineCore
from common.engine.scheduler import Scheduler
from common.engine.worker import Worker
from common.model.layers.moe import Experts, Router
from common.model.quantization.config import QuantConfig, resolve_quantization
from common.model.spec import MoESpec
from common.protocol.sampling_params import SamplingParams
from pdserve.planner.cost_model import ExpertLoad, fit, max_relative_error
from pdserve.planner.profile import (
    DecodePoint,
    MemoryInfo,
    PrefillPoint,
    Profile,
    ProfileKey,
    code_version,
)


@dataclass(frozen=True)
class ProfileGrid:
    prefill_tokens: tuple[int, ...] = (16, 64, 256, 512, 1024, 2048, 4096, 8192)
    chunk_contexts: tuple[int, ...] = (2048, 6144)  # cached tokens before a measured chunk
    chunk_tokens: tuple[int, ...] = (512, 2048)
    decode_batches: tuple[int, ...] = (1, 8, 32, 64, 128, 256)
    decode_contexts: tuple[int, ...] = (256, 1024, 4096)
    decode_steps: int = 8
    repeats: int = 3

    def __post_init__(self) -> None:
        if not self.prefill_tokens or not self.decode_batches or not self.decode_contexts:
            raise ValueError(f"an empty profile grid: {self}")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu:{torch.get_num_threads()}threads"


def quantization_name(scheme: QuantConfig | None) -> str:
    """A scheme's label: "none", or "fp8-" + the weight scales' layout (and block) + "-" +
    the activations' (e.g. "fp8-channel-token", "fp8-block128x128-group")."""
    if scheme is None:
        return "none"
    block = "" if scheme.block is None else f"{scheme.block[0]}x{scheme.block[1]}"
    return f"fp8-{scheme.weights}{block}-{scheme.activations}"


def experts_name(moe: MoESpec | None, expert_parallel: bool) -> str:
    """The key's experts field: "dense", or e.g. "moe128top8-tp" / "moe128top8-ep"."""
    if moe is None:
        return "dense"
    return f"moe{moe.num_experts}top{moe.top_k}-{'ep' if expert_parallel else 'tp'}"


def expert_load(model: torch.nn.Module) -> ExpertLoad | None:
    """This rank's routed experts (None: a dense model): every MoE layer holds the same experts,
    so one expert's bytes are summed over the layers."""
    layers = [m for m in model.modules() if isinstance(m, Experts)]
    if not layers:
        return None
    router = next(m for m in model.modules() if isinstance(m, Router))
    local = len(layers[0].expert_range)
    total = sum(p.numel() * p.element_size() for layer in layers for p in layer.parameters())
    return ExpertLoad(router.moe.num_experts, router.moe.top_k, local, total // local)


def kv_dtype_name(config: EngineConfig, dtype: str) -> str:
    """The KV pool's dtype: the model's for "auto", e4m3 for "fp8"."""
    # Engines from before the FP8 KV cache have no such option: their pool is "auto".
    kv = config.cache.kv_cache_dtype
    names = {"auto": dtype, "fp8": "float8_e4m3fn"}
    if kv not in names:
        raise ValueError(f"kv_cache_dtype must be one of {list(names)}, got {kv!r}")
    return names[kv]


def profile_key(config: EngineConfig, tp: int = 1) -> ProfileKey:
    """The key of the profile `config` would produce, without loading any weights: the weights'
    quantization is the checkpoint's (its config.json) or `--quantization`'s, as the worker
    builds it."""
    from common.engine.worker import pick_device, pick_dtype
    from common.model.source import read_spec, resolve_model

    mc = config.model
    device = pick_device(mc.device)
    dtype = str(pick_dtype(mc.dtype, device)).removeprefix("torch.")
    source = resolve_model(mc.model, dtype=dtype)
    spec = read_spec(source)
    scheme = resolve_quantization(spec.quantization, mc.quantization, mc.load_format)
    model = f"{source.directory}|{mc.load_format}|bs{config.cache.block_size}"
    # Engines from before expert parallelism have no such flag: their experts are sliced.
    ep = bool(getattr(config, "enable_expert_parallel", False))
    return ProfileKey(
        model, dtype, quantization_name(scheme), kv_dtype_name(config, dtype),
        device_name(device), tp, code_version(), experts_name(spec.moe, ep),
        getattr(config, "pp", 1),
    )  # fmt: skip


def profiling_config(config: EngineConfig, grid: ProfileGrid) -> EngineConfig:
    """The user's engine flags with a step budget and a running set as large as the grid."""
    longest = max(
        grid.prefill_tokens + tuple(c + t for c in grid.chunk_contexts for t in grid.chunk_tokens)
    )
    scheduler = dataclasses.replace(
        config.scheduler,
        max_num_batched_tokens=max(longest, max(grid.decode_batches)),
        max_num_seqs=max(grid.decode_batches),
    )
    cache = dataclasses.replace(config.cache, enable_prefix_caching=True)
    model = config.model
    if model.max_model_len is None or model.max_model_len <= longest:
        model = dataclasses.replace(model, max_model_len=longest + 64)
    return dataclasses.replace(config, scheduler=scheduler, cache=cache, model=model)


class Profiler:
    def __init__(
        self, config: EngineConfig, grid: ProfileGrid, log: Callable[[str], None] | None = None
    ) -> None:
        self.grid = grid
        self.log = log or (lambda line: print(line, flush=True))
        self.config = profiling_config(config, grid)
        self.worker = Worker(self.config)
        self.rng = random.Random(0)
        self.ids = 0

    def run(self, key: ProfileKey) -> Profile:
        prefill = self.prefill_points()
        decode = self.decode_points()
        cost = fit(prefill, decode, expert_load(self.worker.model))
        self.log(
            f"fit: largest error on the raw points {max_relative_error(cost, prefill, decode):.1%}"
        )
        created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        return Profile(key, tuple(prefill), tuple(decode), self.memory(), cost, created)

    # -- prefill --------------------------------------------------------------------------
    def prefill_points(self) -> list[PrefillPoint]:
        core = EngineCore(
            self.worker, Scheduler(self.config.scheduler, self.worker.allocator, prefill_only=True)
        )
        fits = self.worker.runtime.max_model_len
        out = []
        for tokens in self.grid.prefill_tokens:
            if tokens < fits:
                out.append(
                    PrefillPoint(tokens, 0, self._median(lambda t=tokens: self._prefill(core, t)))
                )
        bs = self.worker.runtime.block_size
        for context in self.grid.chunk_contexts:
            context -= context % bs
            for tokens in self.grid.chunk_tokens:
                if context and context + tokens < fits:
                    seconds = self._median(lambda c=context, t=tokens: self._prefill(core, t, c))
                    out.append(PrefillPoint(tokens, context, seconds))
        for p in out:
            self.log(
                f"prefill {p.tokens:6d} tokens after {p.context:6d}: {p.seconds * 1000:8.2f} ms"
            )
        return out

    def _prefill(self, core: EngineCore, tokens: int, context: int = 0) -> float:
        """One prefill step of `tokens` new tokens; `context` cached ones come first."""
        prefix = self._prompt(context)
        if context:
            self._run_prompt(core, prefix)  # computes and caches the prefix
        return self._run_prompt(core, prefix + self._prompt(tokens))

    def _run_prompt(self, core: EngineCore, prompt: list[int]) -> float:
        """Prefill `prompt` (one step when it fits the budget); the seconds it took."""
        seq = self.worker.new_sequence(
            self._id(), prompt, SamplingParams(temperature=0, max_tokens=1)
        )
        core.scheduler.add(seq)
        self._sync()
        start = time.perf_counter()
        while seq.num_computed_tokens < len(prompt):
            core.step()
        self._sync()
        elapsed = time.perf_counter() - start
        self.worker.allocator.free(seq.block_ids)  # as PrefillNode._drop: full blocks stay cached
        seq.block_ids = []
        return elapsed

    # -- decode ---------------------------------------------------------------------------
    def decode_points(self) -> list[DecodePoint]:
        out = []
        capacity = self.worker.runtime.num_kv_blocks * self.worker.runtime.block_size
        for context in self.grid.decode_contexts:
            for batch in self.grid.decode_batches:
                steps = 2 + self.grid.decode_steps
                if (
                    batch * (context + steps + 16) > capacity
                    or context + steps >= self.worker.runtime.max_model_len
                ):
                    self.log(f"decode batch {batch} x {context}: does not fit the KV pool, skipped")
                    continue
                seconds = self._decode(batch, context)
                out.append(DecodePoint(batch, context, seconds))
                self.log(
                    f"decode batch {batch:4d} context {context:6d}: {seconds * 1000:8.2f} ms/step"
                )
        return out

    def _decode(self, batch: int, context: int) -> float:
        scheduler = Scheduler(self.config.scheduler, self.worker.allocator)
        core = EngineCore(self.worker, scheduler, overlap=self.config.overlap_scheduling)
        params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
        seqs = [
            self.worker.new_sequence(self._id(), self._prompt(context), params)
            for _ in range(batch)
        ]
        for seq in seqs:
            scheduler.add(seq)
        while not all(s.num_computed_tokens >= context and s.output_token_ids for s in seqs):
            core.step()
        for _ in range(2):  # steady state: every row a decode
            core.step()
        self._sync()
        start = time.perf_counter()
        for _ in range(self.grid.decode_steps):
            core.step()
        self._sync()
        elapsed = (time.perf_counter() - start) / self.grid.decode_steps
        for seq in seqs:
            core.abort(seq.request_id)
        while core.has_work():
            core.step()
        return elapsed

    # -- memory ---------------------------------------------------------------------------
    def memory(self) -> MemoryInfo:
        rt, w = self.worker.runtime, self.worker
        per_token = w.spec.kv_bytes_per_token(w.kv_cache.pool.element_size())
        kv_bytes = (rt.num_kv_blocks + 1) * rt.block_size * per_token
        total = fraction = None
        if w.device.type == "cuda":
            total = torch.cuda.mem_get_info(w.device)[1]
            fraction = self.config.cache.gpu_memory_fraction
        return MemoryInfo(per_token, rt.block_size, kv_bytes, rt.weight_bytes, total, fraction)

    # -- helpers --------------------------------------------------------------------------
    def _median(self, measure: Callable[[], float]) -> float:
        measure()  # warm-up: graph capture, kernel compilation
        return statistics.median(measure() for _ in range(self.grid.repeats))

    def _prompt(self, n: int) -> list[int]:
        vocab = self.worker.runtime.vocab_size
        return [self.rng.randrange(vocab) for _ in range(n)]

    def _id(self) -> str:
        self.ids += 1
        return f"profile-{self.ids}"

    def _sync(self) -> None:
        if self.worker.device.type == "cuda":
            torch.cuda.synchronize(self.worker.device)


def cpu_threads(devices: int) -> int:
    """Threads per node process on CPU, as the launcher gives them (OMP_NUM_THREADS)."""
    return max(1, (os.cpu_count() or 1) // max(1, devices))
