"""`benchmarks/fp8_report.py` on hand-made results: each target's value, PASS or MISS by how
much, a missing run reported as such, and the kernel table shown only for a decode miss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.fp8_report import Check, report

KERNEL_LOG = """engine: {...}
decode loop at batch 1 (greedy), device time per kernel over 20 calls:
-------  ----------
   Name  Self CUDA
-------  ----------
fp8_gemm_kernel  1.2ms
paged_decode  0.4ms
"""


def engine_result(step_s: dict[int, float], ratio: dict[int, float], prefill: dict[int, float],
                  tok_s: float | None, kv_bytes: int, kv_tokens: int) -> dict:  # fmt: skip
    """What bench_engine.py writes, reduced to the fields the report reads."""
    result = {
        "decode": [
            {"mix": "greedy", "overlap": True, "batch": b, "step_s": s, "ratio_to_floor": ratio[b]}
            for b, s in step_s.items()
        ],
        "prefill": [{"tokens": n, "time_s": t} for n, t in prefill.items()],
        "engine": {"kv_bytes_per_token": kv_bytes, "kv_capacity_tokens": kv_tokens},
    }
    if tok_s is not None:
        result["throughput"] = {"ours_256": {"requests": 256, "tokens_per_s": tok_s}}
    return result


def transfer_result(block_bytes: int, recv_s: list[float], verified: bool = True) -> dict:
    rows = [
        {"blocks": blocks, "bytes": blocks * block_bytes, "recv_s": s, "verified": verified}
        for blocks, s in zip((16, 64), recv_s, strict=True)
    ]
    return {"runs": {"cuda_ipc": rows}}


@pytest.fixture
def results(tmp_path: Path) -> Path:
    """Qwen2.5-7B: FP8 within every decode bar, 1.8x at b1, 1.5x prefill, 1.7x offline;
    Qwen3-8B: b1 step 1.30x its floor (a miss by 4%), only 1.2x faster; transfers halved."""
    runs = {
        "q7_bf16": engine_result({1: 9.0, 32: 10.0, 128: 14.0}, {1: 1.1, 32: 1.1, 128: 1.1},
                                 {2048: 30.0, 8192: 150.0}, 10_000.0, 57344, 100_000),
        "q7_fp8": engine_result({1: 5.0, 32: 6.0, 128: 8.0}, {1: 1.2, 32: 1.25, 128: 1.1},
                                {2048: 20.0, 8192: 100.0}, 17_000.0, 28672, 260_000),
        "q7_w8": engine_result({1: 6.0, 32: 7.0, 128: 10.0}, {1: 1.2, 32: 1.2, 128: 1.2},
                               {2048: 20.0, 8192: 101.0}, None, 57344, 130_000),
        "q3_bf16": engine_result({1: 9.6}, {1: 1.1}, {2048: 30.0, 8192: 150.0}, None, 147456,
                                 90_000),
        "q3_fp8": engine_result({1: 8.0}, {1: 1.30}, {2048: 20.0, 8192: 100.0}, None, 73728,
                                200_000),
    }  # fmt: skip
    for name, result in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    for kind, block, times in (("bf16", 917504, [0.010, 0.040]), ("fp8", 458752, [0.006, 0.021])):
        (tmp_path / f"transfer_{kind}.json").write_text(json.dumps(transfer_result(block, times)))
    (tmp_path / "q7_fp8.log").write_text(KERNEL_LOG)
    (tmp_path / "q3_fp8.log").write_text(KERNEL_LOG.replace("fp8_gemm_kernel", "block_gemm"))
    return tmp_path


def test_a_check_passes_at_its_bar_and_a_miss_says_by_how_much():
    assert Check("x", 1.25, "<=", 1.25).verdict() == "PASS"
    assert Check("x", 1.30, "<=", 1.25).verdict() == "MISS by 4.0%"
    assert Check("x", 1.7, ">=", 1.7).verdict() == "PASS"
    assert Check("x", 1.53, ">=", 1.7).verdict() == "MISS by 10.0%"
    assert Check("x", None, ">=", 1.7).verdict() == "no result"
    assert Check("x", 0.6).verdict() == "-" and Check("x", 0.6).passed() is None


def test_every_target_is_judged_from_the_runs_side_by_side(results):
    checks, text = report(results, [results / "q7_fp8.log", results / "q3_fp8.log"])
    got = {
        c.name: (round(c.value, 3) if c.value is not None else None, c.verdict()) for c in checks
    }
    q7, q3 = "Qwen2.5-7B per-channel", "Qwen3-8B block"
    assert got[f"{q7} decode b32: FP8 step / floor"] == (1.25, "PASS")
    assert got[f"{q7} decode b1: bf16 / FP8 step"] == (1.8, "PASS")
    assert got[f"{q7} prefill 8k: bf16 / FP8 time"] == (1.5, "PASS")
    assert got[f"{q7} offline: FP8 / bf16 tok/s"] == (1.7, "PASS")
    assert got[f"{q7} KV bytes/token: bf16 / FP8"] == (2.0, "PASS")
    assert got[f"{q7} KV tokens: FP8 / bf16 KV, FP8 weights"] == (2.0, "PASS")
    assert got[f"{q3} decode b1: FP8 step / floor"] == (1.3, "MISS by 4.0%")
    assert got[f"{q3} decode b32: FP8 step / floor"] == (None, "no result")  # not in the run
    assert got[f"{q3} decode b1: bf16 / FP8 step"] == (1.2, "MISS by 29.4%")
    assert f"{q3} offline: FP8 / bf16 tok/s" not in got  # offline is optional for Qwen3
    assert got["KV bytes/transferred token: bf16 / FP8 (cuda_ipc)"] == (2.0, "PASS")
    assert got["KV transfer time, same tokens: FP8 / bf16 (cuda_ipc)"] == (0.525, "-")
    # The table comes last; a decode miss brings its model's kernel table above it, and only it.
    assert text.splitlines()[-1].startswith("KV transfer time")
    assert "block_gemm" in text and "fp8_gemm_kernel" not in text
    assert text.index("block_gemm") < text.index("\ntarget ")


def test_a_missing_run_or_unverified_transfer_is_no_result(results):
    (results / "q7_w8.json").unlink()
    (results / "q3_fp8.json").unlink()
    bad = transfer_result(458752, [0.006, 0.021], verified=False)
    (results / "transfer_fp8.json").write_text(json.dumps(bad))
    checks, text = report(results, [results / "q3_fp8.log"])
    names = {c.name: c.verdict() for c in checks}
    assert "Qwen2.5-7B per-channel KV tokens: FP8 / bf16 KV, FP8 weights" not in names
    assert names["Qwen3-8B block decode b1: bf16 / FP8 step"] == "no result"
    assert names["KV bytes/transferred token: bf16 / FP8 (cuda_ipc)"] == "no result"
    assert "block_gemm" not in text  # no result is not a miss: no kernel table
