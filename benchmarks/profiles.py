"""Where a benchmark's time goes: the device time per kernel, the host time per function."""

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
