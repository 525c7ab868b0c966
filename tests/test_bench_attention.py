"""`benchmarks/bench_attention.py --smoke`: every variant runs, writes its rows and meets the
fp32 attention over the dequantized cache (the same check the GPU run makes before timing)."""

from __future__ import annotations

import json
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from benchmarks import bench_attention  # noqa: E402


def test_the_smoke_run_times_every_variant_and_checks_each_against_fp32(tmp_path, capsys):
    out = tmp_path / "attn.json"
    assert bench_attention.main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    variants = set(bench_attention.VARIANTS)
    assert {r["variant"] for r in rows if r["kind"] == "decode"} == variants
    assert {r["variant"] for r in rows if r["kind"] == "prefill"} == variants
    assert all(0 <= r["max_err"] <= 3e-2 for r in rows)
    assert "fp8/fp16" in capsys.readouterr().out  # the table printed last
