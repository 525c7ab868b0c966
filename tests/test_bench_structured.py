"""The grammar-mask benchmark (benchmarks/bench_structured.py) runs end to end on CPU at a tiny
size, so the GPU run is known to work; it checks that every row advanced in every timed step."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.pd_stack import ROOT


def test_bench_structured_runs_on_cpu_and_prints_its_table(tmp_path):
    out = tmp_path / "rows.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/bench_structured.py", "--tiny", "--device", "cpu",
         "--batch-sizes", "2", "4", "--steps", "2", "--warmup", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["batch"], r["constrained"]) for r in rows] == [(2, 0), (2, 1), (4, 0), (4, 2)]
    assert all(r["step_ms_median"] > 0 for r in rows)
    assert "step vs unconstrained" in run.stdout.splitlines()[1]
