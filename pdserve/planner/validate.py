"""`--validate K`: launch each of the top K candidates through `scripts/launch_pd.sh` and
measure it with the serving benchmark's sweep (`benchmarks/sweep_layouts.py`: rising Poisson
rates, the same workload, seed and SLO the planner simulated), then set the measured goodput,
TTFT p90 and TPOT p90 beside the predicted ones.

The benchmark and the launch script belong to a pdserve checkout, not to the installed
package: the sweep runs as its own process (`python benchmarks/sweep_layouts.py ...`, with this
interpreter), and its command line and `sweep.json` are the whole interface between the two."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.planner.config import PlanConfig
from pdserve.planner.search import Prediction

SWEEP_SCRIPT = Path("benchmarks") / "sweep_layouts.py"


@dataclass(frozen=True)
class Measured:
    prediction: Prediction
    goodput_per_device: float  # measured
    bound: str  # sweep_layouts: interpolated, lower (no rate failed), none
    ttft_p90_ms: float | None  # at the measured rate nearest the predicted one
    tpot_p90_ms: float | None
    launch_args: list[str]


def sweep_script(checkout: str | None) -> Path:
    """The serving benchmark's sweep: in `checkout` when given, else in the checkout this
    package was imported from (a source tree or an editable install), else in the working
    directory. ValueError when none has it (an installed package without a checkout)."""
    roots = [Path(checkout)] if checkout else [Path(__file__).resolve().parents[2], Path.cwd()]
    for root in roots:
        if (root / SWEEP_SCRIPT).is_file():
            return (root / SWEEP_SCRIPT).resolve()
    where = " or ".join(str(root) for root in roots)
    raise ValueError(
        f"--validate measures with a pdserve checkout's serving benchmark ({SWEEP_SCRIPT} and "
        f"scripts/launch_pd.sh), and {where} has none: give --validate-checkout DIR"
    )


def measure(
    predictions: Sequence[Prediction],
    config: PlanConfig,
    model: str | None,
    launch_flags: Sequence[Sequence[str]],
    gpu: bool,
    transport: str,
) -> list[Measured]:
    """`launch_flags[i]`: the knob and user flags of `predictions[i]` (layout flags come from
    sweep_layouts' own Layout). Each sweep's record is kept as `<layout>.json` in
    `config.validate_out`, beside its stack's log."""
    script = sweep_script(config.validate_checkout)
    out_dir = Path(config.validate_out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for prediction, flags in zip(predictions, launch_flags, strict=True):
        argv = _sweep_args(prediction, config, model, flags, gpu, transport, out_dir)
        name = prediction.layout.name
        done = subprocess.run([sys.executable, str(script), *argv], check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"{script} exited with {done.returncode} measuring {name}; see {out_dir}"
            )
        path = out_dir / f"{name}.json"
        (out_dir / "sweep.json").replace(path)
        record = json.loads(path.read_text())["layouts"][-1]
        results.append(_measured(prediction, record, config))
    return results


def _sweep_args(prediction, config, model, flags, gpu, transport, out_dir) -> list[str]:
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
    return argv


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
