"""Everything one process needs to run the model: weights, KV pool, block allocator, runner.

Built once per engine process. Values found at run time go to `RuntimeInfo`; the frozen
`EngineConfig` is never modified. With `tp > 1` rank 0's Worker starts the other ranks
(`common.engine.tp_ranks`), which build the same Worker and `follow` rank 0's steps; every rank
has the same number of KV blocks (the smallest any rank can hold). With `pp > 1` the node is
pp stages of tp ranks (global rank = stage * tp + tp rank), rank 0 starts them all, and each
stage's Worker builds only its layers (`PPLayout`) and their KV pool, with the same block ids.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from common.engine.block_allocator import BlockAllocator
from common.engine.config import EngineConfig
from common.engine.cuda_graphs import STAGING_DEPTH
from common.engine.kv_cache import (
    DEFAULT_CPU_KV_BYTES,
    KVCache,
    gpu_kv_budget,
    kv_cache_dtype,
    measure_gpu_memory,
    num_blocks_for_budget,
)
from common.engine.kv_format import (
    KVFormat,
    quantization_name,
    scales_summary,
    speculative_name,
)
from common.engine.logits_processors import LogitsProcessors
from common.engine.memory_probe import graph_margin, step_peak_bytes
from common.engine.model_runner import ModelRunner
from common.engine.sequence import Sequence
from common.engine.spec_decode.loading import (
    assemble,
    keep_eagle3_inputs,
    load_proposer_weights,
)
from common.engine.tp_link import StepDriver, StepFollower
from common.engine.tp_ranks import RankHandler, RankProcesses, RankRole
from common.engine.warmup import warm_up
from common.model.attention import create_backend
from common.model.attention.selection import choose_backend
from common.model.distributed import PipeGroup, TPGroup, close_world, init_node_groups
from common.model.loader import build_model
from common.model.parallel import (
    PPLayout,
    StageLayers,
    TPLayout,
    check_expert_parallel,
    rank_spec,
)
from common.model.quantization.config import resolve_quantization
from common.model.source import ModelSource, read_spec, resolve_model
from common.model.spec import ModelSpec
from common.protocol.sampling_params import SamplingParams
from common.text.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RuntimeInfo:
    model_name: str
    device: str
    dtype: str
    attention_backend: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    kv_format: KVFormat  # the pool's dtype and what a KV peer must match (heartbeats: a dict)
    cuda_graph_sizes: tuple[int, ...] = ()
    cuda_graph_bytes: int = 0  # decode graphs (shared logits buffer included)
    prefill_graph_buckets: tuple[int, ...] = ()  # token counts of the prefill/mixed graphs
    prefill_graph_bytes: int = 0
    weight_bytes: int = 0
    tp: int = 1
    expert_parallel: bool = False  # whole experts per rank (the KV is the same either way)
    pp: int = 1
    pp_layers: tuple[int, ...] = ()  # layers per pipeline stage (pp > 1)


def pick_device(name: str, rank: int = 0, tp: int = 1) -> torch.device:
    """`rank`'s device: `cuda:A,B,...` names one GPU per rank; with several ranks `cuda` (or
    `auto` with a GPU) means GPUs 0..tp-1. `tp`: every rank of the node (pp x tp)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and tp > 1:
        ids = name.partition(":")[2].split(",") if ":" in name else [str(r) for r in range(tp)]
        if len(ids) != tp:
            raise ValueError(
                f"device {name!r} must name one GPU per rank ({tp} ranks): cuda:A,B,..."
            )
        name = f"cuda:{ids[rank]}"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        role: RankRole | None = None,
        rank: int = 0,
        init_method: str | None = None,
        drafts: bool = True,
    ) -> None:
        """Rank 0 (the default) starts the other ranks, telling them their `role` (what
        their node does with KV); rank r > 0 joins at `init_method`. `drafts`: load the
        speculative proposer's weights and pool (a prefill node never drafts)."""
        self.config = config
        mc = config.model
        self.device = pick_device(mc.device, rank, config.world_size)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = pick_dtype(mc.dtype, self.device)
        self.source: ModelSource = resolve_model(
            mc.model, dtype=str(self.dtype).removeprefix("torch.")
        )
        self.spec: ModelSpec = read_spec(self.source)
        TPLayout.of(self.spec, config.tp)  # a TP size the model cannot split fails here
        self.pp_layout = PPLayout.of(self.spec.num_layers, config.pp, config.pp_layer_partition)
        if config.enable_expert_parallel:
            check_expert_parallel(self.spec, config.tp)
        method = config.speculative.speculative_method
        if config.pp > 1 and (method != "none" if drafts else method == "eagle3"):
            raise ValueError(
                f"speculative_method={method} with pp={config.pp}: pipelined nodes do not "
                "speculate (decode steps run synchronously there); use --pp 1 for this pool"
            )
        if drafts and method in ("draft", "eagle3") and config.tp > 1:
            # Refused before any rank starts (a prefill pool, which never drafts, may be TP).
            raise ValueError(
                f"speculative_method={method} runs on one rank; this pool has tp={config.tp} "
                "(ngram works with tensor parallelism)"
            )
        if method in ("draft", "eagle3") and self.spec.mla is not None:
            raise ValueError(
                f"speculative_method={method} does not support {self.spec.architecture} "
                "targets (latent attention) yet; use --speculative-method ngram"
            )
        self.ranks = None
        if config.world_size > 1 and rank == 0:
            self.ranks = RankProcesses(config, role or RankRole())
        try:
            self._build(config, rank, init_method, drafts)
        except BaseException:
            if self.ranks is not None:
                # Else they fail on their own, and their watch ends this whole process.
                self.ranks.terminate()
            close_world(config.world_size)  # so this process may build another node
            raise

    def _build(self, config: EngineConfig, rank: int, init_method: str | None, drafts: bool):
        """The rest of `__init__`, once this node's other ranks are started: process groups,
        model, KV pool, graphs, warm-up."""
        mc, cc = config.model, config.cache
        self.tp = TPGroup.single()
        self.pipe: PipeGroup | None = None
        address = self.ranks.init_method if self.ranks else init_method
        ep = config.enable_expert_parallel
        if config.pp > 1:
            self.tp, self.pipe = init_node_groups(
                rank, config.tp, self.pp_layout, address, self.device, expert_parallel=ep
            )
        elif config.tp > 1:
            self.tp = TPGroup.init(rank, config.tp, address, self.device, expert_parallel=ep)
        self.stage = StageLayers.whole(self.spec.num_layers)
        if self.pipe is not None:
            self.stage = StageLayers.of(self.pp_layout, self.pipe.stage)
        # This rank's heads, KV heads and MLP slice: what its layers and KV pool hold.
        self.rank_spec = rank_spec(self.spec, self.tp.layout(self.spec))
        # What its KV pool is sized by: its stage's layers.
        self.kv_spec = dataclasses.replace(self.rank_spec, num_layers=len(self.stage.layers))
        max_len = mc.max_model_len or self.spec.max_position_embeddings
        if not config.scheduler.enable_chunked_prefill:
            # An unsplittable prompt (or a preempted sequence's recompute) must fit one step.
            max_len = min(max_len, config.scheduler.max_num_batched_tokens)
        if self.spec.sliding_window:
            # Within one window sliding-window attention equals full attention.
            max_len = min(max_len, self.spec.sliding_window)
        self.model = build_model(
            self.spec,
            self.source,
            max_positions=max_len,
            dtype=self.dtype,
            device=self.device,
            load_format=mc.load_format,
            seed=mc.seed,
            tp=self.tp,
            quantization=mc.quantization,
            stage=self.stage,
        )
        # Before the KV pool is sized: the GPU's warm-up peak then includes these weights.
        self.proposer_weights = None
        if drafts and rank == 0:
            self.proposer_weights = load_proposer_weights(
                config.speculative,
                self.model,
                self.source,
                tp=config.tp,
                max_model_len=max_len,
                dtype=self.dtype,
                device=self.device,
            )
        elif rank == 0 and config.speculative.speculative_method == "eagle3":
            # A prefill node: its prompts' hidden states ship to the decode node's head.
            keep_eagle3_inputs(config.speculative, self.model)
        self.kv_dtype = kv_cache_dtype(cc.kv_cache_dtype, self.dtype)
        # Only an FP8 pool asks the backends about its dtype: "auto" calls them as before.
        kv_arg = {"kv_dtype": self.kv_dtype} if self.kv_dtype != self.dtype else {}
        backend_name, why = choose_backend(
            config.attention_backend, self.device, cc.block_size, **kv_arg,
            latent=self.spec.mla is not None,
        )  # fmt: skip
        log.info("attention backend: %s (%s)", backend_name, why)
        self.backend = create_backend(backend_name, config.mla_prefill)
        self.use_graphs = self.device.type == "cuda" and not config.enforce_eager
        num_blocks = self._size_kv_cache(max_len)
        num_blocks = self.pipe.min_int(num_blocks) if self.pipe else self.tp.min_int(num_blocks)
        k_scales, v_scales = _kv_scales(self.model)
        self.kv_cache = KVCache.allocate(
            self.rank_spec, num_blocks, cc.block_size, self.kv_dtype, self.device,
            k_scales, v_scales, self.stage.layers,
        )  # fmt: skip
        self.allocator = BlockAllocator(num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.proposer = None  # a draft model or EAGLE-3 head with its pool (n-gram: none)
        if self.proposer_weights is not None:
            self.proposer = assemble(
                self.proposer_weights, num_blocks, cc.block_size, self.dtype, self.device,
                self.backend,
            )  # fmt: skip
        self.runner = ModelRunner(self.model, self.kv_cache, self.backend, self.device)
        self.runner.pipe = self.pipe
        if config.world_size > 1 and rank == 0:
            self.runner.link = StepDriver(self.tp, self.device, self.pipe)
        self.runner.logits_processors = LogitsProcessors(
            lambda: self.tokenizer, self.spec.vocab_size, self.spec.eos_token_ids
        )
        max_model_len = min(max_len, num_blocks * cc.block_size)
        graph_bytes = prefill_graph_bytes = 0
        if self.use_graphs:
            graph_bytes = self.runner.capture_graphs(
                self._decode_graph_rows(), max_model_len, self.decode_rows_max()
            )
            if self.proposer is not None:  # the drafter's own step graphs, as many rows
                graph_bytes += self.proposer.capture_graphs(
                    self._decode_graph_rows(), max_model_len
                )
            # EAGLE-3 reads the target's hidden states of every prompt token, which the
            # piecewise prefill graphs do not keep: its prompts run eagerly.
            eagle = config.speculative.speculative_method == "eagle3"
            if config.prefill_graph_max_tokens and not eagle:
                max_tokens = config.prefill_graph_max_tokens
                prefill_graph_bytes = self.runner.capture_prefill_graphs(max_tokens)
        prefill = self.runner.prefill_graphs
        self.runtime = RuntimeInfo(
            model_name=self.source.name,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            attention_backend=self.backend.name,
            num_kv_blocks=num_blocks,
            block_size=cc.block_size,
            max_model_len=max_model_len,
            vocab_size=self.spec.vocab_size,
            eos_token_ids=self.spec.eos_token_ids,
            kv_format=self._kv_format(),
            cuda_graph_sizes=tuple(self.runner.graphs.sizes) if self.runner.graphs else (),
            cuda_graph_bytes=graph_bytes,
            prefill_graph_buckets=tuple(prefill.buckets) if prefill else (),
            prefill_graph_bytes=prefill_graph_bytes,
            weight_bytes=sum(p.numel() * p.element_size() for p in self.model.parameters()),
            tp=self.tp.size,
            expert_parallel=self.tp.expert_parallel,
            pp=config.pp,
            pp_layers=self.pp_layout.sizes if config.pp > 1 else (),
        )
        if rank == 0 and config.warmup:
            warm_up(self)
        log.info("worker ready (rank %d of %d): %s", rank, config.world_size, self.runtime)

    @functools.cached_property
    def tokenizer(self) -> Any | None:
        """The model's HF tokenizer (None when it ships none), loaded on first use: a node
        needs it only for grammars, and importing transformers costs seconds of CPU."""
        return load_tokenizer(self.source.directory)

    def follow(self, handler: RankHandler | None = None) -> None:
        """A rank > 0: run rank 0's steps until it says stop; `handler` acts on its commands
        and gives the per-layer hook of steps rank 0 runs with one (`kv_transfer.tp`). Like
        rank 0, it keeps one step in flight: a replay's staging slot is given back once the
        step after it was queued and the replayed step has finished (an event)."""
        follower = StepFollower(self.tp, self.device, self.pipe)
        prev_ids = None
        pending: deque[tuple[Any, torch.cuda.Event | None]] = deque()
        while (message := follower.receive()) is not None:
            if isinstance(message[0], dict):
                if handler is not None:
                    handler.command(*message)
                continue
            h, flags = message
            while len(pending) >= STAGING_DEPTH:
                replay, done = pending.popleft()
                if done is not None:
                    done.synchronize()
                replay.release()
            hook = handler.layer_hook(flags) if handler is not None else None
            replay = self.runner.follow(h, prev_ids, hook)
            prev_ids = follower.receive_ids(len(h.sample_rows))
            if replay is not None:
                done = torch.cuda.Event() if self.device.type == "cuda" else None
                if done is not None:
                    done.record()
                pending.append((replay, done))
        for replay, done in pending:
            if done is not None:
                done.synchronize()
            replay.release()
        self.runner.wait_sends()

    def close(self) -> None:
        """Rank 0: stop the other ranks (they return from `follow`), then leave the group."""
        if self.runner.link is not None:
            self.runner.link.stop()
            self.runner.link = None
        if self.ranks is not None:
            self.ranks.stop()
            self.ranks = None
        if self.pipe is not None:
            close_world(self.config.world_size)
        else:
            self.tp.close()

    def new_sequence(self, request_id: str, prompt: Any, params: SamplingParams) -> Sequence:
        """A validated Sequence for this process: ValueError (with the offending values) for an
        empty prompt, a token outside the vocabulary, or a prompt at or past the context limit.
        `prompt` is a list of ints or an integer array (a received IntArray); the range check is
        vectorised."""
        rt = self.runtime
        try:
            ids = np.asarray(prompt)
        except (TypeError, ValueError, OverflowError):
            ids = np.zeros((0, 0))
        if ids.size == 0 and ids.ndim == 1:
            raise ValueError("the prompt is empty")
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError("token ids must be a flat list of integers")
        bad = ids[(ids < 0) | (ids >= rt.vocab_size)]
        if bad.size:
            raise ValueError(
                f"token ids out of vocabulary [0, {rt.vocab_size}): {bad[:5].tolist()}"
            )
        if len(ids) >= rt.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the context limit is {rt.max_model_len}"
            )
        self.runner.logits_processors.check(params)  # a grammar that cannot compile fails here
        if params.prompt_logprobs is not None and self.config.world_size > 1:
            # The vocabulary-parallel head would need every rank in each projection; with
            # pipeline stages the LM head is on the last one, not on rank 0.
            raise ValueError(
                f"prompt_logprobs are not supported on a node with tp={self.config.tp}, "
                f"pp={self.config.pp}"
            )
        return Sequence(
            request_id,
            ids.tolist(),
            params,
            frozenset(rt.eos_token_ids),
            max_model_len=rt.max_model_len,
        )

    def _size_kv_cache(self, max_len: int) -> int:
        cc = self.config.cache
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            self._profile_peak_memory(max_len)
            memory = measure_gpu_memory(self.device)  # before _graph_bytes resets the peak
            # Captured graphs keep their steps' activations (and the shared logits buffer) in
            # their own pools; measured here so the KV pool leaves room.
            graphs = self._graph_bytes() if self.use_graphs else 0
            budget = gpu_kv_budget(memory, cc.gpu_memory_fraction, graphs)
            log.info("GPU memory: %s, graphs %d bytes, KV budget %d bytes", memory, graphs, budget)
        else:
            budget = DEFAULT_CPU_KV_BYTES
        extra = 0
        if self.proposer_weights is not None:
            extra = self.proposer_weights.block_bytes(cc.block_size, self.dtype)
        return num_blocks_for_budget(self.kv_spec, cc.block_size, self.kv_dtype, budget, extra)

    def _decode_graph_rows(self) -> int:
        """Most rows of a decode step: one per sequence, or with speculation one per verified
        token of the sequences of a speculating step (at most speculative_max_batch)."""
        n, sc = self.config.scheduler.max_num_seqs, self.config.speculative
        if not sc.enabled:
            return n
        return max(n, min(n, sc.speculative_max_batch) * (sc.num_speculative_tokens + 1))

    def decode_rows_max(self) -> int:
        """Most decode rows of one sequence in a step: K + 1 with speculation, else 1."""
        sc = self.config.speculative
        return sc.num_speculative_tokens + 1 if sc.enabled else 1

    def _graph_bytes(self) -> int:
        """What the captured graphs will hold, from eager steps of their largest shapes: the
        decode sizes share one pool and one logits buffer (the largest size is the peak), the
        prefill buckets another pool (the largest bucket is the peak)."""
        bs, n = self.config.cache.block_size, self._decode_graph_rows()
        kv = self.kv_dtype
        total = graph_margin(step_peak_bytes(self.model, self.backend, bs, [1] * n, kv))
        weights = self.proposer_weights
        if weights is not None and weights.method == "draft":  # its graphs' own pool
            total += graph_margin(step_peak_bytes(weights.model, self.backend, bs, [1] * n))
        if self.config.prefill_graph_max_tokens:
            tokens = [self.config.prefill_graph_max_tokens]
            total += graph_margin(step_peak_bytes(self.model, self.backend, bs, tokens, kv))
        return total

    def _profile_peak_memory(self, max_len: int) -> None:
        """Run the largest step once on a scratch KV pool so the peak activation size is known."""
        sc, bs = self.config.scheduler, self.config.cache.block_size
        tokens = [min(sc.max_num_batched_tokens, max_len)]
        step_peak_bytes(self.model, self.backend, bs, tokens, self.kv_dtype)

    def _kv_format(self) -> KVFormat:
        """This pool's `KVFormat`: the architecture and its cache geometry (all KV heads,
        whatever this rank holds), the pool's dtype and scales, the linear quantization that
        computes K and V, and the speculative method with its draft model (resolved like
        --model)."""
        mc, kv, spec = self.config.model, self.kv_cache, self.spec
        geometry = spec.kv_cache_geometry
        held = (kv.pool.shape[1], kv.pool.shape[-1])
        assert held == (geometry.planes, geometry.head_dim), (held, geometry)
        scheme = resolve_quantization(spec.quantization, mc.quantization, mc.load_format)
        sc = self.config.speculative
        draft = None
        if sc.speculative_method in ("draft", "eagle3"):
            draft = resolve_model(sc.speculative_model, str(self.dtype).removeprefix("torch."))
        return KVFormat(
            kv_dtype=str(kv.pool.dtype).removeprefix("torch."),
            kv_scales=scales_summary(kv.k_scales, kv.v_scales) if kv.is_fp8 else "none",
            quantization=quantization_name(scheme),
            architecture=spec.architecture,
            num_layers=spec.num_layers,
            planes=geometry.planes,
            num_kv_heads=geometry.heads,
            head_dim=geometry.head_dim,
            block_size=kv.block_size,
            speculative=speculative_name(sc.speculative_method, draft),
        )


def _kv_scales(model: torch.nn.Module) -> tuple[list[float], list[float]]:
    """Per-layer K and V scales the attention layers loaded from the checkpoint (their buffers
    hold 1.0 when it has none), in layer order."""
    buffers = list(model.named_buffers())
    k = [float(b) for name, b in buffers if name.endswith("self_attn.k_scale")]
    v = [float(b) for name, b in buffers if name.endswith("self_attn.v_scale")]
    return k, v
