"""Frozen configuration dataclasses, composed per role, and CLI flags derived from their fields.

Values found at run time (number of KV blocks, EOS ids, the chosen backend) live in
`RuntimeInfo`, never written back here.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from common.model.quantization.config import QUANTIZATION_CHOICES

KV_CACHE_DTYPES = ("auto", "fp8")
# `common.model.attention.base.MLA_PREFILL_MODES`, which imports torch; a test keeps them equal.
MLA_PREFILL_MODES = ("auto", "absorbed", "decompressed")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = field(
        default=None,
        metadata={"help": "HF directory, .gguf file, or none for the embedded SmolLM2"},
    )
    load_format: str = field(
        default="auto",
        metadata={
            "help": "auto (weights from the checkpoint) or dummy (random)",
            "choices": ("auto", "dummy"),
        },
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16",
            "choices": ("auto", "float32", "bfloat16", "float16"),
        },
    )
    quantization: str = field(
        default="auto",
        metadata={
            "help": "auto (as the checkpoint is stored: FP8 checkpoints are detected from "
            "config.json) or fp8 (quantize a bf16/fp16/fp32 checkpoint at load: per-channel "
            "weights, dynamic per-token activations)",
            "choices": QUANTIZATION_CHOICES,
        },
    )
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda, cuda:N"})
    max_model_len: int | None = field(
        default=None, metadata={"help": "longest prompt + output; default: the model's"}
    )
    seed: int = field(default=0, metadata={"help": "seed for dummy weights"})

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata={
            "help": "KV pool size in bytes (default: 1 GiB on CPU, what --gpu-memory-fraction "
            "leaves on GPU)"
        },
    )
    gpu_memory_fraction: float = field(
        default=0.85,
        metadata={
            "help": "GPU: share of the GPU's total memory this process may use: weights, CUDA "
            "graphs, activations and the KV pool, whatever other processes use, so nodes "
            "sharing a GPU each take their share (fractions summing to at most 1; unset, "
            "pdserve serve splits the default among the nodes it puts on one GPU). "
            "--kv-memory-fraction is the old name",
            "aliases": ("kv_memory_fraction",),
        },
    )
    num_kv_blocks: int | None = field(
        default=None, metadata={"help": "force the number of KV blocks"}
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "reuse KV of identical prompt prefixes"}
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "auto (KV in the model dtype) or fp8 (float8_e4m3fn, twice the tokens in "
            "the same memory: per-layer K and V scales from the checkpoint, else 1.0, inside "
            "whose +-448 range Llama-family K and V stay; values beyond saturate). Prefill and "
            "decode nodes must agree",
            "choices": KV_CACHE_DTYPES,
        },
    )

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(
                f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}"
            )
        for name in ("kv_cache_memory_bytes", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=128, metadata={"help": "most sequences in one step"})
    max_num_batched_tokens: int = field(
        default=2048, metadata={"help": "token budget of one step (prefill chunks + decodes)"}
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata={"help": "split long prompts across steps"}
    )

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


SPECULATIVE_METHODS = ("none", "ngram", "draft", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    speculative_method: str = field(
        default="none",
        metadata={
            "help": "none, ngram (prompt lookup over the prompt and output), draft (a smaller "
            "model with the same tokenizer: --speculative-model) or eagle3 (EAGLE-3 draft "
            "heads: --speculative-model)",
            "choices": SPECULATIVE_METHODS,
        },
    )
    num_speculative_tokens: int = field(
        default=4, metadata={"help": "tokens drafted per speculating sequence and step (K)"}
    )
    speculative_model: str | None = field(
        default=None, metadata={"help": "draft model or EAGLE-3 head directory"}
    )
    speculative_ngram_min: int = field(
        default=1, metadata={"help": "ngram: shortest suffix looked up in the earlier tokens"}
    )
    speculative_ngram_max: int = field(
        default=4, metadata={"help": "ngram: longest suffix looked up in the earlier tokens"}
    )
    speculative_max_batch: int = field(
        default=32,
        metadata={
            "help": "speculate only in steps of at most this many running sequences. Measured "
            "on an H200 (Qwen2.5-7B, K=4, docs/benchmarks.md): a verify step costs x1.1 / "
            "x1.1 / x1.35 / x2.0 a plain overlapped step at batch 1 / 8 / 32 / 64, so past 32 "
            "it pays only above ~2 tokens per step, which free chat does not reach"
        },
    )

    def __post_init__(self) -> None:
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.speculative_method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}"
            )
        if self.speculative_method in ("draft", "eagle3") and not self.speculative_model:
            raise ValueError(
                f"speculative_method={self.speculative_method} needs --speculative-model"
            )
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError(
                "speculative_ngram_min and speculative_ngram_max must satisfy "
                f"1 <= min <= max, got {self.speculative_ngram_min}, {self.speculative_ngram_max}"
            )
        if self.speculative_max_batch < 1:
            raise ValueError(
                f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}"
            )

    @property
    def enabled(self) -> bool:
        return self.speculative_method != "none"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": "auto, torch, triton, flash_attn",
            "choices": ("auto", "torch", "triton", "flash_attn"),
        },
    )
    mla_prefill: str = field(
        default="auto",
        metadata={
            "help": "DeepSeek (MLA) prefill steps: absorbed (attention over the cached latent "
            "rows, as decode), decompressed (each head's K and V rebuilt from the latents: "
            "~3.4x fewer attention FLOPs, plus a GEMM per context token), or auto (per "
            "sequence: decompressed for long chunks, common.model.attention.mla_prefill."
            "AUTO_DECOMPRESS). Other models ignore it",
            "choices": MLA_PREFILL_MODES,
        },
    )
    tp: int = field(
        default=1,
        metadata={
            "help": "tensor-parallel ranks of a node, one process and one device each (rank 0 "
            "is the node; --device cuda:A,B,... names one GPU per rank); per pool: "
            "--prefill-tp, --decode-tp"
        },
    )
    pp: int = field(
        default=1,
        metadata={
            "help": "pipeline-parallel stages of a node, one process per stage and TP rank "
            "(pp x tp devices); each stage holds a range of layers and their KV, prefill "
            "chunks flow through the stages back to back; per pool: --prefill-pp, --decode-pp"
        },
    )
    pp_layer_partition: str | None = field(
        default=None,
        metadata={
            "help": "layers per pipeline stage, comma-separated (e.g. 10,18 for 28 layers and "
            "--pp 2); default: even, earlier stages take the remainder"
        },
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata={
            "help": "mixture-of-experts models: each of the --tp ranks holds whole experts "
            "(1/tp of them) instead of a 1/tp slice of every expert; attention stays tensor "
            "parallel and the KV is unchanged, so pools with and without it pair; per pool: "
            "--prefill-enable-expert-parallel, --decode-enable-expert-parallel"
        },
    )
    enforce_eager: bool = field(default=False, metadata={"help": "never capture CUDA graphs"})
    # 2048, not 1024: an eager 2k-token FP8 prefill step on an H200 took 33-70 ms from run to
    # run (launch-bound: its kernels sum to ~29 ms), graphed 33 ms; +0.33 GB of graph memory
    # for Qwen2.5-7B.
    prefill_graph_max_tokens: int = field(
        default=2048,
        metadata={
            "help": "CUDA-graph prefill and mixed steps of up to this many tokens (token-count "
            "buckets, piecewise around attention; a multiple of 16; 0: eager); --enforce-eager "
            "turns every graph off"
        },
    )
    overlap_scheduling: bool = field(
        default=True,
        metadata={
            "help": "decode: schedule and stage step N+1 while step N runs, outputs one step "
            "behind (--no-overlap-scheduling: the synchronous loop, for comparison)"
        },
    )
    warmup: bool = field(
        default=True,
        metadata={
            "help": "GPU: before the node reports ready, sample once with every kind of "
            "request (filters, penalties, seeds, logprobs, logit_bias, grammar masks) at each "
            "graph size, so no kernel compiles under the first requests (--no-warmup: skip it)"
        },
    )

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.pp < 1:
            raise ValueError(f"pp must be >= 1, got {self.pp}")
        if self.pp_layer_partition is not None and self.pp == 1:
            raise ValueError("pp_layer_partition needs pp > 1")
        if self.mla_prefill not in MLA_PREFILL_MODES:
            raise ValueError(
                f"mla_prefill must be one of {MLA_PREFILL_MODES}, got {self.mla_prefill!r}"
            )

    @property
    def world_size(self) -> int:
        """Processes (and devices) of one node: every stage's tensor-parallel ranks."""
        return self.tp * self.pp

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """Build from flat keyword options (`block_size=32, max_num_seqs=8, ...`)."""
        parts: dict[str, dict[str, Any]] = {part: {} for part in _SUBCONFIGS}
        top: dict[str, Any] = {}
        owners = {f.name: part for part, sub in _SUBCONFIGS.items() for f in fields(sub)}
        renamed = {  # old option names still accepted
            a: f.name for sub in _SUBCONFIGS.values() for f in fields(sub)
            for a in f.metadata.get("aliases", ())
        }  # fmt: skip
        for key, value in options.items():
            key = renamed.get(key, key)
            if key in owners:
                parts[owners[key]][key] = value
            elif key in {f.name for f in fields(cls)} and key not in _SUBCONFIGS:
                top[key] = value
            else:
                raise ValueError(f"unknown engine option {key!r}")
        return cls(
            model=ModelConfig(**parts["model"]),
            cache=CacheConfig(**parts["cache"]),
            scheduler=SchedulerConfig(**parts["scheduler"]),
            speculative=SpeculativeConfig(**parts["speculative"]),
            **top,
        )

    def flat_options(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _SUBCONFIGS}
        for part in _SUBCONFIGS:
            out.update(dataclasses.asdict(getattr(self, part)))
        return out


_SUBCONFIGS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "speculative": SpeculativeConfig,
}


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """One `--flag` per field, default and help taken from the field."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name in _SUBCONFIGS and cls is EngineConfig:
            add_dataclass_args(parser, _SUBCONFIGS[f.name], prefix)
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        aliases = ["--" + prefix + a.replace("_", "-") for a in f.metadata.get("aliases", ())]
        default = f.default if f.default is not dataclasses.MISSING else None
        kind = _scalar_type(hints[f.name])
        help_text = f.metadata.get("help", "")
        choices = f.metadata.get("choices")
        if kind is bool:
            parser.add_argument(
                flag,
                *aliases,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag,
                *aliases,
                dest=f.name,
                type=kind,
                default=default,
                choices=choices,
                help=f"{help_text} (default: {default})",
            )


def _scalar_type(hint: Any) -> type:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for sub in _SUBCONFIGS.values() for f in fields(sub)}
    names |= {f.name for f in fields(EngineConfig) if f.name not in _SUBCONFIGS}
    return EngineConfig.from_options(**{n: getattr(args, n) for n in names if hasattr(args, n)})
