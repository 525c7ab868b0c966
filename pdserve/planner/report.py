"""The ranked table and the launch command of a candidate.

The command holds only flags `pdserve serve` has: it is built here and parsed back with the
real parser (`serve_command` raises if any flag is unknown), so what is printed always starts.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from pdserve.planner.layout import Knobs, Layout
from pdserve.planner.search import Prediction

# The knob each pool's flag carries; the planner sets these, the user's values for them yield.
KNOB_FLAGS = {
    "prefill_max_num_batched_tokens": "--prefill-max-num-batched-tokens",
    "decode_max_num_batched_tokens": "--decode-max-num-batched-tokens",
    "decode_max_num_seqs": "--decode-max-num-seqs",
}


def table(predictions: Sequence[Prediction], top: int, attainment: float, rate_mode: str) -> str:
    head = (
        f"{'#':>2} {'layout':<10} {'dev':>3} {'knobs':<34} {'goodput/dev':>11} {'rate':>8} "
        f"{'TTFT p90':>9} {'TPOT p90':>9} {'attain':>7}"
    )
    lines = [
        f"ranked by predicted goodput per device ({rate_mode}; target {attainment:.0%} attainment)",
        head,
    ]
    for i, p in enumerate(predictions[:top], 1):
        lines.append(
            f"{i:>2} {p.layout.name:<10} {p.layout.devices:>3} {p.knobs.describe(p.layout):<34} "
            f"{p.goodput_per_device:>11.3f} {p.rate:>8.3f} {_ms(p.ttft_ms['p90']):>9} "
            f"{_ms(p.tpot_ms['p90']):>9} {p.attainment:>7.1%}"
        )
    return "\n".join(lines)


def _ms(value: float) -> str:
    return "-" if value != value else f"{value:.0f} ms"  # NaN: no request had that value


def launch_args(
    layout: Layout,
    knobs: Knobs,
    gpu: bool,
    user_flags: Sequence[str] = (),
    transport: str | None = None,
) -> list[str]:
    """`pdserve serve` flags for a candidate: the layout, its knobs, then the user's model and
    engine flags (`user_flags`, those the knobs do not set)."""
    return layout_flags(layout, gpu, transport) + knob_flags(layout, knobs) + list(user_flags)


def layout_flags(layout: Layout, gpu: bool, transport: str | None = None) -> list[str]:
    if layout.prefill_tp > 1 or layout.decode_tp > 1:
        raise ValueError(f"layout {layout.name}: this pdserve has no TP flags to launch it with")
    if layout.colocated:
        out = ["--colocated", "--num-decode", str(layout.num_decode)]
        return out + (["--decode-gpus", _ids(0, layout.num_decode)] if gpu else [])
    out = ["--num-prefill", str(layout.num_prefill), "--num-decode", str(layout.num_decode)]
    if gpu:
        out += ["--prefill-gpus", _ids(0, layout.num_prefill)]
        out += ["--decode-gpus", _ids(layout.num_prefill, layout.num_decode)]
    return out + ["--transport", transport or ("cuda_ipc" if gpu else "zmq")]


def knob_flags(layout: Layout, knobs: Knobs) -> list[str]:
    out = []
    if not layout.colocated:
        out += [
            KNOB_FLAGS["prefill_max_num_batched_tokens"],
            str(knobs.prefill_max_num_batched_tokens),
        ]
    default_budget = _engine_default("max_num_batched_tokens")
    if layout.colocated or knobs.decode_max_num_batched_tokens != default_budget:
        out += [
            KNOB_FLAGS["decode_max_num_batched_tokens"],
            str(knobs.decode_max_num_batched_tokens),
        ]
    out += [KNOB_FLAGS["decode_max_num_seqs"], str(knobs.decode_max_num_seqs)]
    if knobs.kv_memory_fraction is not None:
        out += ["--gpu-memory-fraction", f"{knobs.kv_memory_fraction:g}"]
    return out


def _ids(start: int, count: int) -> str:
    return ",".join(str(i) for i in range(start, start + count))


def _engine_default(name: str) -> Any:
    from common.engine.config import EngineConfig

    return EngineConfig().flat_options()[name]


def user_engine_flags(options: dict[str, dict[str, Any]], skip: set[str]) -> list[str]:
    """The engine and node flags a user gave `pdserve plan`, as `pdserve serve` flags: one
    `--X` where both pools agree, `--prefill-X` / `--decode-X` where they differ. `skip`:
    field names the candidate's flags set (`transport`, `gpu_memory_fraction`, ...)."""
    out = []
    names = sorted(set(options["prefill"]) | set(options["decode"]))
    for name in names:
        if name in skip:
            continue
        p, d = options["prefill"].get(name), options["decode"].get(name)
        if p == d:
            out += _flag(name, p)
            continue
        for pool, value in (("prefill", p), ("decode", d)):
            if value is not None and f"{pool}_{name}" not in KNOB_FLAGS:
                out += _flag(name, value, pool)
    return out


def _flag(name: str, value: Any, pool: str | None = None) -> list[str]:
    flag = name.replace("_", "-")
    if isinstance(value, bool):
        flag = flag if value else "no-" + flag
        return [f"--{pool}-{flag}" if pool else f"--{flag}"]
    return [f"--{pool}-{flag}" if pool else f"--{flag}", str(value)]


def serve_command(model: str | None, args: Sequence[str]) -> str:
    """The command line, checked against the real `pdserve serve` parser first."""
    from pdserve.flags import build_parser

    argv = ["serve", *([model] if model else []), *args]
    build_parser().parse_args(argv)  # SystemExit on a flag pdserve serve does not have
    return "pdserve " + shlex.join(argv)
