"""`pdserve plan`: flags -> profile (cached) -> search -> table and command -> validation."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.planner.config import PlanConfig, plan_config_from_args
from pdserve.planner.layout import Layout
from pdserve.planner.profile import Profile, ProfileCache
from pdserve.planner.report import (
    knob_flags,
    launch_args,
    serve_command,
    table,
    user_engine_flags,
)
from pdserve.planner.search import Objective, Prediction, Problem, SearchSpace, SimParams, search

DEFAULT_FRACTIONS = (0.85, 0.9)
BANDWIDTH_GBPS = {"cuda_ipc": 100.0, "zmq": 2.0}


@dataclass(frozen=True)
class Setup:
    """What the user's engine flags fix for the search."""

    model: str | None
    options: dict[str, dict[str, Any]]  # per pool, the engine and node flags given
    gpu: bool
    transport: str


def main(args: argparse.Namespace) -> int:
    from pdserve.plan import pool_options

    config = plan_config_from_args(args)
    if config.validate:
        from pdserve.planner.validate import sweep_script

        sweep_script(config.validate_checkout)  # no checkout: fail before profiling
    setup = _setup(args, pool_options(args))
    profiles = {tp: _profile(config, setup, tp) for tp in config.tp_sizes}
    problem = _problem(config, setup, profiles)
    space = _space(config, setup, profiles[1] if 1 in profiles else next(iter(profiles.values())))
    jobs = config.jobs or os.cpu_count() or 1
    predictions = search(problem, space, jobs)
    mode = "rate max" if config.rate is None else f"rate {config.rate:g} req/s"
    print(table(predictions, config.top, config.attainment, mode))
    best = predictions[0]
    flags = _launch(best, setup)
    if best.goodput > 0 and best.attainment >= config.attainment:
        head = f"best: {best.layout.name} ({best.knobs.describe(best.layout)}), predicted "
        head += f"{best.goodput_per_device:.3f} req/s per device"
    else:
        head = f"no candidate meets the SLO for {config.attainment:.0%} of requests; the closest"
    print(f"\n{head}\n{serve_command(setup.model, flags)}")
    print("(scripts/launch_pd.sh takes the same flags)")
    measured = []
    if config.validate:
        from pdserve.planner import validate

        first = config.validate_from - 1
        top = best_per_layout(predictions)[first : first + config.validate]
        flags = [knob_flags(p.layout, p.knobs) + _user_flags(p, setup) for p in top]
        measured = validate.measure(top, config, setup.model, flags, setup.gpu, setup.transport)
        print("\n" + validate.table(measured))
    if config.out:
        _write(Path(config.out), config, predictions, measured, setup)
    return 0


def best_per_layout(predictions: list[Prediction]) -> list[Prediction]:
    """The best-ranked knobs of each layout with a goodput, in rank order: what --validate
    launches (K layouts, not K knob settings of one layout)."""
    seen: set[Layout] = set()
    out = []
    for p in predictions:
        if p.goodput > 0 and p.layout not in seen:
            seen.add(p.layout)
            out.append(p)
    return out


def _setup(args: argparse.Namespace, options: dict[str, dict[str, Any]]) -> Setup:
    model = args.model_arg or args.model
    from pdserve.plan import gpu_count

    device = options["decode"].get("device", "auto")
    gpu = device.startswith("cuda") or (device == "auto" and gpu_count() > 0)
    transport = options["prefill"].get("transport") or ("cuda_ipc" if gpu else "zmq")
    return Setup(model, options, gpu, transport)


def _engine_config(setup: Setup):
    from common.engine.config import EngineConfig
    from pdserve.plan import NODE_FIELDS

    options = {k: v for k, v in setup.options["decode"].items() if k not in NODE_FIELDS}
    return EngineConfig.from_options(model=setup.model, **options)


def _profile(config: PlanConfig, setup: Setup, tp: int) -> Profile:
    import torch

    from pdserve.planner.profiler import ProfileGrid, Profiler, cpu_threads, profile_key

    engine = _engine_config(setup)
    if not setup.gpu:
        torch.set_num_threads(cpu_threads(config.devices))  # as the launcher splits the cores
    key = profile_key(engine, tp)
    cache = ProfileCache(Path(config.profile_cache).expanduser())
    cached = None if config.reprofile else cache.get(key)
    if cached is not None:
        print(f"profile from {cache.path} ({key.describe()}, {cached.created})")
        return cached
    if tp != 1:
        raise ValueError(
            f"--tp-sizes {tp}: the planner profiles TP 1 only (nodes run any TP size, the "
            f"profiler does not yet) and no TP {tp} profile is cached for {key}"
        )
    grid = ProfileGrid(
        config.profile_prefill_tokens, config.profile_chunk_contexts, config.profile_chunk_tokens,
        config.profile_decode_batches, config.profile_decode_contexts,
        repeats=config.profile_repeats,
    )  # fmt: skip
    print(f"profiling {key.model} ({key.describe()})", flush=True)
    profiler = Profiler(engine, grid)
    profile = profiler.run(key)
    del profiler  # the weights, KV pool and graphs: --validate's nodes need the GPU memory
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    cache.put(profile)
    print(f"profile cached in {cache.path}")
    return profile


def _problem(config: PlanConfig, setup: Setup, profiles: dict[int, Profile]) -> Problem:
    from pdserve.planner.workload import sim_requests
    from pdserve.workload.slo import SLO

    decode = setup.options["decode"]
    kv_blocks = None
    memory = next(iter(profiles.values())).memory
    if "num_kv_blocks" in decode:
        kv_blocks = decode["num_kv_blocks"]
    elif "kv_cache_memory_bytes" in decode:
        kv_blocks = (
            decode["kv_cache_memory_bytes"] // (memory.kv_bytes_per_token * memory.block_size) - 1
        )
    gbps = config.kv_bandwidth_gbps or BANDWIDTH_GBPS.get(setup.transport, 2.0)
    params = SimParams(
        gbps * 1e9, config.transfer_latency_ms / 1000, config.overhead_ms / 1000,
        config.decode_policy, config.prefill_policy,
        setup.options["decode"].get("kv_growth_headroom", 0.1),
        setup.options["prefill"].get("max_num_seqs", 128), kv_blocks,
        config.router_us_per_token / 1e6,
    )  # fmt: skip
    objective = Objective(SLO.parse(config.slo), config.attainment, config.rate)
    return Problem(profiles, sim_requests(config, _tokenizer(setup)), objective, params)


def _tokenizer(setup: Setup) -> Any | None:
    if setup.model is None:
        return None
    from common.text.tokenizer import load_tokenizer

    path = Path(setup.model)
    return load_tokenizer(path) if path.is_dir() else None


def _space(config: PlanConfig, setup: Setup, profile: Profile) -> SearchSpace:
    """The search grids, with every knob the user fixed by a flag held at that value."""
    prefill, decode = setup.options["prefill"], setup.options["decode"]
    fractions: tuple[float | None, ...] = (None,)
    if "gpu_memory_fraction" in decode:
        fractions = (decode["gpu_memory_fraction"],)
    elif (
        setup.gpu
        and profile.memory.total_bytes
        and not {"num_kv_blocks", "kv_cache_memory_bytes"} & set(decode)
    ):
        fractions = config.search_kv_fractions or DEFAULT_FRACTIONS
    return SearchSpace(
        devices=config.devices,
        prefill_tokens=_fixed(prefill, "max_num_batched_tokens", config.search_prefill_tokens),
        decode_seqs=_fixed(decode, "max_num_seqs", config.search_decode_seqs),
        colocated_tokens=_fixed(decode, "max_num_batched_tokens", config.search_colocated_tokens),
        kv_fractions=fractions,
        layouts=tuple(Layout.parse(x) for x in config.layouts),
        decode_tokens=decode.get("max_num_batched_tokens", 2048),
    )


def _fixed(options: dict[str, Any], name: str, grid: tuple[int, ...]) -> tuple[int, ...]:
    return (options[name],) if name in options else grid


SET_BY_CANDIDATE = {"transport", "gpu_memory_fraction"}


def _user_flags(p: Prediction, setup: Setup) -> list[str]:
    skip = SET_BY_CANDIDATE if p.knobs.kv_memory_fraction is not None else {"transport"}
    return user_engine_flags(setup.options, skip)


def _launch(p: Prediction, setup: Setup) -> list[str]:
    return launch_args(p.layout, p.knobs, setup.gpu, _user_flags(p, setup), setup.transport)


def _write(path: Path, config: PlanConfig, predictions: list[Prediction], measured, setup) -> None:
    rows = [
        {**dataclasses.asdict(p), "layout": p.layout.name, "goodput_per_device": p.goodput_per_device,
         "command": serve_command(setup.model, _launch(p, setup))}
        for p in predictions
    ]  # fmt: skip
    validation = [
        {"layout": m.prediction.layout.name, "knobs": dataclasses.asdict(m.prediction.knobs),
         "predicted_goodput_per_device": m.prediction.goodput_per_device,
         "measured_goodput_per_device": m.goodput_per_device, "bound": m.bound,
         "predicted_ttft_p90_ms": m.prediction.ttft_ms["p90"], "measured_ttft_p90_ms": m.ttft_p90_ms,
         "predicted_tpot_p90_ms": m.prediction.tpot_ms["p90"], "measured_tpot_p90_ms": m.tpot_p90_ms,
         "launch_args": m.launch_args}
        for m in measured
    ]  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": dataclasses.asdict(config), "predictions": rows,
                                "validation": validation}, indent=1))  # fmt: skip
    print(f"wrote {path}", file=sys.stderr)
