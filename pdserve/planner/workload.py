"""The serving benchmark's workload as the simulator's requests: the same specs
(`pdserve.workload.datasets`) and the same arrival schedule (`arrival_offsets`, gamma
gaps from the seed) that `bench_serving.py` and `sweep_layouts.py` send, at 1 request/s (the
search rescales it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdserve.planner.config import PlanConfig
from pdserve.planner.simulator import SimRequest
from pdserve.workload.arrivals import arrival_offsets
from pdserve.workload.datasets import RequestSpec, WorkloadConfig, build_workload

WORDS_TO_TOKENS = 1.3  # a text prompt's length when the model ships no tokenizer


def workload_config(config: PlanConfig) -> WorkloadConfig:
    return WorkloadConfig(
        dataset=config.dataset, num_prompts=config.num_prompts, seed=config.workload_seed,
        input_len=config.input_len, output_len=config.output_len,
        num_groups=config.num_groups, prefix_len=config.prefix_len,
        dataset_path=config.dataset_path,
    )  # fmt: skip


def sim_requests(config: PlanConfig, tokenizer: Any | None = None) -> tuple[SimRequest, ...]:
    wc = workload_config(config)
    specs = build_workload(wc)
    offsets = arrival_offsets(len(specs), 1.0, config.burstiness, config.workload_seed)
    count = _counter(tokenizer)
    return tuple(
        SimRequest(t, count(s), s.output_len, s.group, wc.prefix_len if s.group is not None else 0)
        for t, s in zip(offsets, specs, strict=True)
    )


def _counter(tokenizer: Any | None) -> Callable[[RequestSpec], int]:
    def count(spec: RequestSpec) -> int:
        if spec.prompt_token_ids is not None:
            return len(spec.prompt_token_ids)
        if tokenizer is not None:
            return len(tokenizer.encode(spec.prompt))
        return max(1, round(spec.prompt_len * WORDS_TO_TOKENS))

    return count
