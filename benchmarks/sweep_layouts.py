"""Goodput of serving layouts on the same GPUs: PD xPyD against N colocated instances.

    python benchmarks/sweep_layouts.py --model benchmarks/configs/qwen2.5-7b-instruct \\
        --load-format dummy --gpus 0,1,2,3 --layouts 1p3d 2p2d 3p1d 4c \\
        --dataset long-prompt --slo ttft:3000 tpot:20 --rates-per-gpu 1 2 3 4 5 \\
        --duration 30 --out results/sweep_long

Each layout is started once through `scripts/launch_pd.sh` (PD over `--transport`, default
cuda_ipc, or N colocated decode nodes behind one router: data parallel, chunked prefill on) and
stays up across its rate points. Rates rise until the SLO attainment (requests that meet every
objective, over all requests sent) falls below `--attainment` and `--points-past-knee` more
points were run. A point stops early once it cannot reach the attainment any more (more
misses than it allows), and in-flight requests are cancelled `--drain-timeout` seconds after
the last arrival, so an overloaded point costs little. A layout's **goodput** is the highest
rate whose attainment is at least `--attainment`, interpolated between the last point above
and the first below it (DistServe's definition), and it is compared per GPU.

Between points the nodes must go back to holding no KV blocks (checked and recorded). Per
point the CPU use of every process of the stack is recorded (a saturated router or node
loop shows there). Writes `sweep.json` and `sweep.png` into `--out`; `--plot-only DIR...`
redraws one figure from several sweeps (for example two layouts run side by side on
disjoint GPUs).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script: the repository's packages

from benchmarks.bench_serving import benchmark, warm_up  # noqa: E402
from benchmarks.loadgen.client import RequestResult, Target  # noqa: E402
from benchmarks.loadgen.report import write_json  # noqa: E402
from benchmarks.loadgen.runner import RunConfig, StopRule  # noqa: E402
from benchmarks.stack import PDStack, same_python_env  # noqa: E402
from benchmarks.sweep_plot import plot_sweeps  # noqa: E402
from benchmarks.sweep_probe import StackProbe  # noqa: E402
from pdserve.workload.datasets import DATASETS, WorkloadConfig, build_workload  # noqa: E402
from pdserve.workload.slo import SLO  # noqa: E402


@dataclass(frozen=True)
class Layout:
    """`XpYd`: X prefill and Y decode processes; `Nc`: N colocated processes. One GPU each."""

    name: str
    prefill: int
    decode: int

    @property
    def colocated(self) -> bool:
        return self.prefill == 0

    @property
    def gpus(self) -> int:
        return self.prefill + self.decode

    @classmethod
    def parse(cls, text: str) -> Layout:
        pd = re.fullmatch(r"(\d+)p(\d+)d", text.lower())
        if pd and int(pd[1]) >= 1 and int(pd[2]) >= 1:
            return cls(text.lower(), int(pd[1]), int(pd[2]))
        colo = re.fullmatch(r"(\d+)c", text.lower())
        if colo and int(colo[1]) >= 1:
            return cls(text.lower(), 0, int(colo[1]))
        raise ValueError(f"layout {text!r} is neither XpYd (X, Y >= 1) nor Nc (N >= 1)")

    def launch_args(self, gpus: list[int], transport: str) -> list[str]:
        if gpus and len(gpus) < self.gpus:
            raise ValueError(f"layout {self.name} needs {self.gpus} GPUs, --gpus gives {gpus}")
        ids = [str(g) for g in gpus[: self.gpus]]
        if self.colocated:
            out = ["--colocated", "--num-decode", str(self.decode)]
            return out + (["--decode-gpus", ",".join(ids)] if ids else [])
        out = ["--num-prefill", str(self.prefill), "--num-decode", str(self.decode)]
        out += ["--transport", transport]
        if ids:
            out += ["--prefill-gpus", ",".join(ids[: self.prefill])]
            out += ["--decode-gpus", ",".join(ids[self.prefill :])]
        return out


def max_goodput_rate(points: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """The highest rate with attainment >= target, interpolated linearly between the last
    point at or above it and the next point below it. `bound` says what the value is:
    "interpolated", "lower" (no measured point fell below the target) or "none"."""
    ordered = sorted(points, key=lambda p: p["rate"])
    best = None
    for i, p in enumerate(ordered):
        if p["attainment"] < target:
            continue
        best = (i, p)
    if best is None:
        return {"rate": 0.0, "bound": "none"}
    i, p = best
    if i + 1 == len(ordered):
        return {"rate": p["rate"], "bound": "lower"}
    q = ordered[i + 1]
    span = p["attainment"] - q["attainment"]
    frac = (p["attainment"] - target) / span if span > 0 else 0.0
    return {"rate": p["rate"] + (q["rate"] - p["rate"]) * frac, "bound": "interpolated"}


def run_layout(
    layout: Layout,
    args: argparse.Namespace,
    env: dict[str, str],
    done: list[dict[str, Any]],
    save: Callable[[], None],
) -> None:
    """Sweep one layout. Its record joins `done` first and grows point by point, and `save`
    runs after each point, so a run cut short keeps what it measured."""
    launch = layout.launch_args(args.gpus, args.transport) + _common_launch_args(args)
    print(f"== {layout.name}: launch_pd.sh {' '.join(launch)}", flush=True)
    started = time.monotonic()
    log_path = args.out / f"{layout.name}.log"
    points: list[dict[str, Any]] = []
    out: dict[str, Any] = {
        "layout": layout.name, "gpus": layout.gpus, "launch_args": launch, "points": points,
        "max_goodput": {"rate": 0.0, "bound": "none", "per_gpu": 0.0},
    }  # fmt: skip
    done.append(out)
    stack = PDStack(*launch, log_path=log_path, start_timeout_s=args.health_timeout + 60, env=env)
    try:
        out["start_s"] = time.monotonic() - started
        print(f"   healthy after {out['start_s']:.0f} s", flush=True)
        model = stack.get("/v1/models")[1]["data"][0]["id"]
        target = Target(stack.url, model, temperature=args.temperature)
        probe = StackProbe(stack)
        warm_up(target, _workload(args, 8 * layout.gpus, seed=10_000), args.warmup_requests)
        below = 0
        for k, per_gpu in enumerate(sorted(args.rates_per_gpu)):
            point = run_point(layout, per_gpu, k, target, probe, args)
            points.append(point)
            out["max_goodput"] = _max_goodput(points, args.attainment, layout.gpus)
            save()
            _print_point(point)
            # The knee is that of the loosest objective (--stop-slo), so that every SLO
            # between it and --slo can be scored afterwards from the per-request rows.
            below += point["stop_attainment"] < args.attainment
            if below > args.points_past_knee or point["stop_attainment"] < args.give_up_below:
                break
    finally:
        left = stack.stop()
        out["orphans"] = left
        print(f"   stopped{'; STILL ALIVE: ' + str(left) if left else ''}", flush=True)
    save()


def _max_goodput(points: list[dict[str, Any]], target: float, gpus: int) -> dict[str, Any]:
    out = max_goodput_rate(points, target)
    out["per_gpu"] = out["rate"] / gpus
    return out


def run_point(layout, per_gpu, k, target, probe, args) -> dict[str, Any]:
    rate = per_gpu * layout.gpus
    num = max(1, math.ceil(rate * args.duration))
    specs = _workload(args, num, seed=args.seed + k)
    slo, stop_slo = SLO.parse(args.slo), SLO.parse(args.stop_slo or args.slo)
    config = RunConfig(
        request_rate=rate, burstiness=args.burstiness, seed=args.seed + k,
        client_processes=args.client_processes, drain_timeout_s=args.drain_timeout,
        stop_when_missed=StopRule.for_attainment(stop_slo, args.attainment, num),
        progress=False,
    )  # fmt: skip
    probe.start()
    result = benchmark(target, specs, config, slo)
    cpu = probe.stop()
    held = probe.wait_idle(timeout_s=60)
    summary = result["summary"]
    point = {
        "rate": rate,
        "rate_per_gpu": per_gpu,
        "attainment": summary["attainment"],
        "stop_attainment": _attainment(result["requests"], stop_slo),
        "goodput": summary["goodput"],
        "goodput_per_gpu": summary["goodput"] / layout.gpus,
        "stopped_early": result["stopped_early"],
        "summary": summary,
        "server_phases": result["server_phases"],
        "cpu_percent": cpu,
        "cpu_by_thread": probe.threads,
        "held_blocks_after": held,
    }
    # Enough of every request to score any other SLO afterwards (rescore); ITLs stay out.
    point["requests"] = [{k: r[k] for k in REQUEST_KEYS} for r in result["requests"]]
    return point


REQUEST_KEYS = ("sent", "ttft", "tpot", "e2e", "output_tokens", "success", "error")


def _attainment(rows: list[dict[str, Any]], slo: SLO) -> float:
    good = sum(1 for r in rows if slo.met(RequestResult.from_dict(_row(r))))
    return good / len(rows) if rows else 0.0


def _row(r: dict[str, Any]) -> dict[str, Any]:
    keep = ("ttft", "e2e", "output_tokens", "success", "error")
    return {"index": 0, "scheduled": 0.0, **{k: r.get(k) for k in keep}}


def rescore(layout: dict[str, Any], slo: SLO, target: float) -> dict[str, Any]:
    """A layout's goodput under another SLO, from the per-request rows of its points (valid
    for SLOs at least as tight as the --stop-slo the sweep ran with)."""
    points = [
        {"rate": p["rate"], "attainment": _attainment(p["requests"], slo)} for p in layout["points"]
    ]
    out = max_goodput_rate(points, target)
    out["per_gpu"] = out["rate"] / layout["gpus"]
    return out


def _workload(args: argparse.Namespace, num: int, seed: int):
    return build_workload(
        WorkloadConfig(
            dataset=args.dataset, num_prompts=num, seed=seed, input_len=args.input_len,
            output_len=args.output_len, num_groups=args.num_groups, prefix_len=args.prefix_len,
            dataset_path=args.dataset_path,
        )
    )  # fmt: skip


def _common_launch_args(args: argparse.Namespace) -> list[str]:
    out = ["--health-timeout", str(args.health_timeout)]
    if args.model:
        out += ["--model", args.model]
    if args.load_format != "auto":
        out += ["--prefill-load-format", args.load_format, "--decode-load-format", args.load_format]
    for extra in args.launch_arg:
        out += extra.split()
    return out


def _print_point(p: dict[str, Any]) -> None:
    s = p["summary"]
    ttft, tpot = s["ttft_ms"], s["tpot_ms"]
    print(
        f"   rate {p['rate']:6.2f}/s ({p['rate_per_gpu']:.2f}/GPU): attainment "
        f"{p['attainment'] * 100:5.1f}%  goodput {p['goodput']:6.2f}/s  "
        f"TTFT p90 {_ms(ttft['p90'])}  TPOT p90 {_ms(tpot['p90'])}  failed {s['failed']}"
        f"{'  (stopped early)' if p['stopped_early'] else ''}",
        flush=True,
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def print_table(layouts: list[dict[str, Any]], slo: SLO, target: float) -> None:
    scored = [(x, rescore(x, slo, target)) for x in layouts]
    colo = [g["per_gpu"] for x, g in scored if x["layout"].endswith("c")]
    base = max(colo) if colo else None
    objectives = " ".join(f"{k.removesuffix('_ms')}:{v:g}" for k, v in slo.to_dict().items())
    print(f"\nSLO {objectives} ms, {target * 100:g}% attainment")
    print(f"{'layout':>8} {'GPUs':>4} {'goodput req/s':>14} {'per GPU':>8} {'vs coloc':>9}")
    for x, g in scored:
        ratio = f"x{g['per_gpu'] / base:.2f}" if base else "-"
        flag = {"lower": " (>=)", "none": " (none)"}.get(g["bound"], "")
        print(
            f"{x['layout']:>8} {x['gpus']:>4} {g['rate']:>14.2f} {g['per_gpu']:>8.2f} "
            f"{ratio:>9}{flag}"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = p.add_argument
    add(
        "--layouts",
        nargs="+",
        type=Layout.parse,
        default=[Layout.parse("1p1d"), Layout.parse("2c")],
    )
    add("--gpus", type=lambda t: [int(g) for g in t.split(",") if g], default=[])
    add("--model", default="", help="default: the embedded SmolLM2")
    add("--load-format", default="auto", choices=["auto", "dummy"])
    add("--transport", default="cuda_ipc", choices=["cuda_ipc", "zmq"])
    add("--launch-arg", action="append", default=[], help="more launch_pd.sh flags (repeatable)")
    add("--dataset", choices=DATASETS, default="long-prompt")
    add("--dataset-path", default=None)
    add("--input-len", default=None)
    add("--output-len", default=None)
    add("--num-groups", type=int, default=8)
    add("--prefix-len", type=int, default=2048)
    add("--slo", nargs="+", default=["ttft:3000", "tpot:20"], metavar="KEY:MS")
    add(
        "--stop-slo",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="loosest SLO of interest: points stop early and rates stop rising by it "
        "(default: --slo); any SLO between --slo and it can be scored afterwards",
    )
    add(
        "--extra-slo",
        nargs="+",
        action="append",
        default=[],
        metavar="KEY:MS",
        help="also print the goodput table for this SLO (repeatable)",
    )
    add("--attainment", type=float, default=0.9)
    add("--rates-per-gpu", nargs="+", type=float, default=[1, 2, 3, 4, 5, 6])
    add("--duration", type=float, default=30.0, help="seconds of arrivals per point")
    add("--drain-timeout", type=float, default=30.0)
    add("--points-past-knee", type=int, default=1)
    add("--give-up-below", type=float, default=0.3, help="stop a layout below this attainment")
    add("--burstiness", type=float, default=1.0)
    add("--temperature", type=float, default=0.0)
    add("--seed", type=int, default=0)
    add("--warmup-requests", type=int, default=8)
    add("--client-processes", type=int, default=1)
    add("--health-timeout", type=int, default=900)
    add("--out", type=Path, default=Path("benchmarks/results/sweep"))
    add("--plot-only", nargs="+", type=Path, default=None, metavar="DIR")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.plot_only:
        found = [d / "sweep.json" for d in args.plot_only if (d / "sweep.json").exists()]
        for d in args.plot_only:
            if not (d / "sweep.json").exists():
                print(f"no sweep.json in {d}: left out", file=sys.stderr)
        sweeps = [json.loads(path.read_text()) for path in found]
        if not sweeps:
            return 1
        layouts = [x for s in sweeps for x in s["layouts"]]
        for slo in [args.slo, *args.extra_slo]:
            print_table(layouts, SLO.parse(slo), args.attainment)
        plot_sweeps(args.out / "sweep.png", sweeps)
        return 0
    for slo in [args.slo, args.stop_slo or args.slo, *args.extra_slo]:
        SLO.parse(slo)  # fail on a typo before anything starts
    args.out.mkdir(parents=True, exist_ok=True)
    env = same_python_env(args.out / "shim_venv")
    result: dict[str, Any] = {"config": _config(args), "layouts": []}

    def save() -> None:  # after every point: what is done so far survives a crash
        write_json(args.out / "sweep.json", result)

    for layout in args.layouts:
        run_layout(layout, args, env, result["layouts"], save)
    for slo in [args.slo, *args.extra_slo]:
        print_table(result["layouts"], SLO.parse(slo), args.attainment)
    plot_sweeps(args.out / "sweep.png", [result])
    return 0


def _config(args: argparse.Namespace) -> dict[str, Any]:
    out = {k: v for k, v in vars(args).items() if k not in ("layouts", "out", "plot_only")}
    out["layouts"] = [x.name for x in args.layouts]
    out["out"] = str(args.out)
    return out


if __name__ == "__main__":
    sys.exit(main())
