"""What the benchmark scripts do with a result: draw it (matplotlib is optional), record the
flags it ran with, and write it beside its figure and table."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Result = dict[str, Any]


def pyplot() -> Any | None:
    """matplotlib's pyplot drawing to files (the Agg backend, no display), or None when
    matplotlib is not installed: the caller then writes no figure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def args_record(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as JSON values (paths as text), for the result's "args"."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def publish(
    result: Result,
    path: Path,
    plot: Callable[[Result, Path], None],
    print_table: Callable[[Result], None],
) -> None:
    """Write `result` as JSON to `path`, its figure beside it (`.png`), its table last."""
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    plot(result, path.with_suffix(".png"))
    print_table(result)
