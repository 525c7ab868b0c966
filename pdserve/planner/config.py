"""`pdserve plan`'s own flags: one frozen dataclass, flags derived from its fields (the model
and engine flags are `pdserve serve`'s, added by `pdserve.flags`)."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.engine.config import _scalar_type

DEFAULT_CACHE = str(Path.home() / ".cache" / "pdserve" / "planner_profiles.json")


def _f(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class PlanConfig:
    devices: int = _f(1, "devices to plan for (GPUs; on a machine without one, CPU processes)")
    dataset: str = _f(
        "random", "the serving benchmark's dataset: random, long-prompt, chat, shared-prefix"
    )
    dataset_path: str | None = _f(None, "JSONL trace (overrides --dataset), as bench_serving.py")
    input_len: str | None = _f(None, "N, A:B or lognormal:MEDIAN:SIGMA:LO:HI")
    output_len: str | None = _f(None, "same forms as --input-len")
    num_groups: int = _f(8, "shared-prefix: distinct system prompts")
    prefix_len: int = _f(2048, "shared-prefix: system prompt length")
    num_prompts: int = _f(400, "requests simulated per rate")
    workload_seed: int = _f(0, "workload and arrival seed (the benchmark's --seed)")
    request_rate: str = _f("max", "requests/s, or max: the highest rate meeting the SLO")
    burstiness: float = _f(1.0, "gamma shape of the arrival gaps; 1 = Poisson")
    slo: tuple[str, ...] = _f(
        ("ttft:3000", "tpot:50"), "objectives, as --goodput: ttft:MS tpot:MS e2el:MS"
    )
    attainment: float = _f(0.9, "fraction of requests that must meet every objective")
    profile_cache: str = _f(DEFAULT_CACHE, "JSON file of profiles (model, dtype, device, TP, code)")
    reprofile: bool = _f(False, "measure again even when the cache has the profile")
    profile_prefill_tokens: tuple[int, ...] = _f(
        (16, 64, 256, 512, 1024, 2048, 4096, 8192), "profiled prompt sizes"
    )
    profile_chunk_contexts: tuple[int, ...] = _f((2048, 6144), "profiled context before a chunk")
    profile_chunk_tokens: tuple[int, ...] = _f((512, 2048), "profiled chunk sizes after a context")
    profile_decode_batches: tuple[int, ...] = _f(
        (1, 8, 32, 64, 128, 256), "profiled decode batches"
    )
    profile_decode_contexts: tuple[int, ...] = _f((256, 1024, 4096), "profiled decode contexts")
    profile_repeats: int = _f(3, "measurements per prefill point (median)")
    layouts: tuple[str, ...] = _f((), "only these layouts (XpYd, Nc); default: every one")
    tp_sizes: tuple[int, ...] = _f(
        (1,),
        "TP sizes per pool to consider; the profiler measures TP 1 only, other sizes "
        "need a cached profile",
    )
    search_prefill_tokens: tuple[int, ...] = _f(
        (1024, 2048, 4096), "prefill --max-num-batched-tokens tried"
    )
    search_decode_seqs: tuple[int, ...] = _f((64, 128, 256), "decode --max-num-seqs tried")
    search_colocated_tokens: tuple[int, ...] = _f(
        (512, 1024, 2048), "colocated chunk budgets tried"
    )
    search_kv_fractions: tuple[float, ...] = _f(
        (), "GPU --kv-memory-fraction values tried (default 0.85 0.9)"
    )
    kv_bandwidth_gbps: float | None = _f(None, "KV transfer GB/s (default: 100 cuda_ipc, 2 zmq)")
    transfer_latency_ms: float = _f(1.0, "fixed cost of one KV transfer")
    overhead_ms: float = _f(5.0, "router, sockets and HTTP per request, added to TTFT")
    router_us_per_token: float = _f(
        80.0, "router CPU per streamed token: a rate that keeps it >85% busy fails (0: off)"
    )
    prefill_policy: str = _f(
        "least_load", "router policy simulated", choices=("least_load", "round_robin")
    )
    decode_policy: str = _f(
        "least_load", "router policy simulated", choices=("least_load", "round_robin")
    )
    jobs: int = _f(0, "worker processes for the search (0: one per CPU)")
    top: int = _f(10, "rows of the ranked table")
    validate: int = _f(0, "launch the top K candidates and measure them with the serving benchmark")
    validate_from: int = _f(1, "with --validate K: start at this rank (K candidates from there)")
    validate_duration: float = _f(20.0, "seconds of arrivals per measured rate")
    validate_rates: tuple[float, ...] = _f(
        (0.6, 0.85, 1.1), "measured rates, as fractions of the predicted one"
    )
    validate_warmup: int = _f(8, "warm-up requests per launched layout, not measured")
    validate_out: str = _f("benchmarks/results/plan_validate", "where --validate writes its sweeps")
    validate_checkout: str | None = _f(
        None,
        "pdserve checkout whose benchmarks/sweep_layouts.py measures --validate's candidates "
        "(default: the one this package runs from, else the working directory)",
    )
    out: str | None = _f(None, "write every prediction (and validation) as JSON here")

    def __post_init__(self) -> None:
        from pdserve.workload.datasets import DATASETS
        from pdserve.workload.slo import SLO

        if self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}; known: {', '.join(DATASETS)}")
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")
        if self.num_prompts < 10:
            raise ValueError(f"num_prompts must be >= 10, got {self.num_prompts}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"request_rate must be > 0 or max, got {self.request_rate!r}")
        if not SLO.parse(self.slo):  # ValueError names a bad objective
            raise ValueError("give at least one objective, e.g. --slo ttft:1000 tpot:50")
        if self.validate_from < 1:
            raise ValueError(f"validate_from must be >= 1, got {self.validate_from}")
        if self.validate < 0 or self.top < 1:
            raise ValueError(f"validate must be >= 0 and top >= 1, got {self.validate}, {self.top}")

    @property
    def rate(self) -> float | None:
        if self.request_rate == "max":
            return None
        try:
            return float(self.request_rate)
        except ValueError:
            raise ValueError(
                f"request_rate must be a number or max, got {self.request_rate!r}"
            ) from None


def add_plan_args(group: Any) -> None:
    """One flag per PlanConfig field; defaults stay in the dataclass (flags default to None)."""
    hints = typing.get_type_hints(PlanConfig)
    for f in dataclasses.fields(PlanConfig):
        hint, flag = _scalar_type(hints[f.name]), "--" + f.name.replace("_", "-")
        shown = " ".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
        text = f"{f.metadata['help']} (default: {shown if shown not in (None, '') else 'none'})"
        text = text.replace("%", "%%")  # argparse formats help strings with %
        dest = f"plan__{f.name}"
        if hint is bool:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, help=text)
        elif typing.get_origin(hint) is tuple:
            kind = typing.get_args(hint)[0]
            group.add_argument(
                flag, dest=dest, nargs="*", type=kind, metavar=f.name.upper(), help=text
            )
        else:
            group.add_argument(
                flag, dest=dest, type=hint, choices=f.metadata.get("choices"),
                metavar=None if f.metadata.get("choices") else f.name.upper(), help=text,
            )  # fmt: skip


def plan_config_from_args(args: argparse.Namespace) -> PlanConfig:
    values = {}
    for f in dataclasses.fields(PlanConfig):
        value = getattr(args, f"plan__{f.name}")
        if value is not None:
            values[f.name] = tuple(value) if isinstance(value, list) else value
    return PlanConfig(**values)
