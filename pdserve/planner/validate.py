"""`--validate K`: launch each of the top K candidates through `scripts/launch_pd.sh` and
measure it with the serving benchmark's sweep (`benchmarks/sweep_layouts.py` `run_layout`:
rising Poisson rates, the same workload, seed and SLO the planner simulated), then set the
measured goodput, TTFT p90 and TPOT p90 beside the predicted ones."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import sweep_layouts
from benchmarks.loadgen.report import write_json
from benchmarks.stack import same_python_env
from pdserve.planner.config import PlanConfig
from pdserve.planner.search import Prediction


@dataclass(frozen=True)
class Measured:
    prediction: Prediction
    goodput_per_device: float  # measured
    bound: str  # sweep_layouts: interpolated, lower (no rate failed), none
    ttft_p90_ms: float | None  # at the measured rate nearest the predicted one
    tpot_p90_ms: float | None
    launch_args: list[str]


def measure(
    predictions: Sequence[Prediction],
    config: PlanConfig,
    model: str | None,
    launch_flags: Sequence[Sequence[str]],
    gpu: bool,
    transport: str,
) -> list[Measured]:
    """`launch_flags[i]`: the knob and user flags of `predictions[i]` (layout flags come from
    sweep_layouts' own Layout)."""
    out_dir = Path(config.validate_out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = same_python_env(out_dir / "shim_venv")
    done: list[dict[str, Any]] = []
    results = []
    for prediction, flags in zip(predictions, launch_flags, strict=True):
        args = _sweep_args(prediction, config, model, flags, gpu, transport, out_dir)
        path = out_dir / f"{prediction.layout.name}.json"
        config_record = {**vars(args), "out": str(args.out), "layouts": prediction.layout.name}

        def save(path: Path = path, record: dict[str, Any] = config_record) -> None:
            write_json(path, {"config": record, "layouts": done[-1:]})

        layout = sweep_layouts.Layout.parse(prediction.layout.name)
        sweep_layouts.run_layout(layout, args, env, done, save)
        results.append(_measured(prediction, done[-1], config))
    return results


def _sweep_args(prediction, config, model, flags, gpu, transport, out_dir):
    devices = prediction.layout.devices
    if config.rate is not None:
        per_device = [config.rate / devices]
    else:
        per_device = [prediction.goodput_per_device * f for f in config.validate_rates]
    argv = [
        "--layouts", prediction.layout.name, "--transport", transport,
        "--dataset", config.dataset, "--num-groups", str(config.num_groups),
        "--prefix-len", str(config.prefix_len), "--slo", *config.slo,
        "--attainment", str(config.attainment), "--duration", str(config.validate_duration),
        "--burstiness", str(config.burstiness), "--seed", str(config.workload_seed),
        "--rates-per-gpu", *[f"{r:.6g}" for r in per_device if r > 0],
        "--points-past-knee", str(len(per_device)), "--give-up-below", "0",
        "--warmup-requests", str(config.validate_warmup),
        "--out", str(out_dir), "--launch-arg", shlex.join(flags),
    ]  # fmt: skip
    if gpu:
        argv += ["--gpus", ",".join(str(i) for i in range(devices))]
    for name, value in (("--model", model), ("--dataset-path", config.dataset_path),
                        ("--input-len", config.input_len), ("--output-len", config.output_len)):  # fmt: skip
        if value:
            argv += [name, value]
    return sweep_layouts.build_parser().parse_args(argv)


def _measured(prediction: Prediction, record: dict[str, Any], config: PlanConfig) -> Measured:
    points = record["points"]
    best = record["max_goodput"]
    if config.rate is not None and points:
        per_device = points[0]["goodput_per_gpu"]
    else:
        per_device = best["per_gpu"]
    # A point that stopped early has percentiles of the few requests that finished: prefer
    # the complete ones.
    complete = [p for p in points if not p["stopped_early"]] or points
    near = min(complete, key=lambda p: abs(p["rate"] - prediction.rate), default=None)
    summary = near["summary"] if near else {}
    return Measured(
        prediction, per_device, best["bound"],
        summary.get("ttft_ms", {}).get("p90"), summary.get("tpot_ms", {}).get("p90"),
        record["launch_args"],
    )  # fmt: skip


def table(measured: Sequence[Measured]) -> str:
    lines = [
        "predicted against measured (goodput per device, req/s; measured p90 at the complete "
        "point nearest the predicted rate)",
        f"{'layout':<10} {'knobs':<34} {'goodput pred':>12} {'measured':>12} {'TTFT p90 pred/meas':>20} "
        f"{'TPOT p90 pred/meas':>20}",
    ]
    for m in measured:
        p = m.prediction
        bound = {"lower": " (>=)", "none": " (none)"}.get(m.bound, "")
        lines.append(
            f"{p.layout.name:<10} {p.knobs.describe(p.layout):<34} {p.goodput_per_device:>12.3f} "
            f"{m.goodput_per_device:>7.3f}{bound:<5} "
            f"{_pair(p.ttft_ms['p90'], m.ttft_p90_ms):>20} {_pair(p.tpot_ms['p90'], m.tpot_p90_ms):>20}"
        )
    return "\n".join(lines)


def _pair(predicted: float, measured: float | None) -> str:
    meas = "-" if measured is None else f"{measured:.0f}"
    pred = "-" if predicted != predicted else f"{predicted:.0f}"
    return f"{pred} / {meas} ms"
