"""Where a benchmark's time goes: the device time per kernel, the host time per function, and
where in one call the device waits on the host (`timeline`)."""

from __future__ import annotations

import cProfile
import io
import pstats
from collections.abc import Callable

import torch


def kernel_table(fn: Callable[[], object], calls: int, rows: int = 25) -> str:
    """torch.profiler's table of the device time per kernel over `calls` calls of `fn`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70
    )
    return f"device time per kernel over {calls} calls:\n{table}"


def host_table(fn: Callable[[], object], calls: int, rows: int = 18) -> str:
    """cProfile's table of the host time per function (own time) over `calls` calls of `fn`."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(rows)
    return f"host time per function over {calls} calls:\n{out.getvalue()}"


def timeline(fn: Callable[[], object], gaps: int = 12) -> str:
    """Where one call of `fn` spends its wall time on a GPU: the host's time before the first
    device activity, the device's busy time (kernels and copies, overlaps merged), the idle
    gaps between them, and for the longest gaps the Python frame that launched the work after
    each (so a gap reads as "the device waited on this host code")."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    if not torch.cuda.is_available():
        return "timeline: needs a GPU"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        with record_function("timeline_call"):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    return timeline_report(events, gaps)


def timeline_report(
    events: list[dict], gaps: int, device_cats=("kernel", "gpu_memcpy", "gpu_memset")
) -> str:
    """`timeline`'s report from a chrome trace's events (the call is the span named
    "timeline_call")."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    call = next(e for e in spans if e["name"] == "timeline_call")
    device = sorted(
        (e for e in spans if e.get("cat") in device_cats),
        key=lambda e: e["ts"],
    )
    launches = {
        e["args"]["correlation"]: e
        for e in spans
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    frames = [e for e in spans if e.get("cat") == "python_function"]
    if not device:
        return "timeline: no device activity recorded"
    busy, end, last, idle = 0.0, device[0]["ts"], device[0], []
    for e in device:
        if e["ts"] > end:
            idle.append((e["ts"] - end, end, last, e))
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
        if e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    t0 = call["ts"]
    lines = [
        f"call {end - t0:.0f} us to the last device activity (host call {call['dur']:.0f} us); "
        f"device busy {busy:.0f} us in {len(device)} activities; host before the first "
        f"{device[0]['ts'] - t0:.0f} us; idle between {sum(g for g, *_ in idle):.0f} us in "
        f"{len(idle)} gaps"
    ]

    def frame_of(e: dict) -> str:
        launch = launches.get(e.get("args", {}).get("correlation"))
        if launch is None:
            return "?"
        inside = [
            f for f in frames
            if f["ts"] <= launch["ts"] and launch["ts"] <= f["ts"] + f["dur"]
            and "torch/" not in f["name"] and "<built-in" not in f["name"]
        ]  # fmt: skip
        return min(inside, key=lambda f: f["dur"])["name"] if inside else launch["name"]

    for gap, at, prev, nxt in sorted(idle, key=lambda g: -g[0])[:gaps]:
        lines.append(
            f"  {gap:8.1f} us at +{at - t0:.0f}: {prev['name'][:40]} -> {nxt['name'][:40]}, "
            f"launched from {frame_of(nxt)[:90]}"
        )
    return "\n".join(lines)
