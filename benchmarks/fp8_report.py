"""The FP8 targets of one `benchmarks/fp8_gpu_suite.sh` run: each one's measured value, PASS or
MISS and by how much. Every ratio pairs two results of the same device call (bf16 and FP8 one
after the other on one GPU); each floor comes from the ceilings its own run measured.

    python benchmarks/fp8_report.py RESULTS_DIR [--kernel-log RESULTS_DIR/q7_fp8.log ...]

RESULTS_DIR holds, per model prefix (q7: Qwen2.5-7B, FP8 per channel; q3: Qwen3-8B, FP8
128 x 128 blocks; optionally qm: Qwen3-30B-A3B, FP8 blocks, W8A8 experts; ds:
Moonlight-16B-A3B (DeepSeek-V3), FP8 blocks with kv_b_proj dequantized, FP8 latent cache),
`bench_engine.py` results PREFIX_bf16.json (bf16 weights and KV),
PREFIX_fp8.json (FP8 weights and KV) and optionally PREFIX_w8.json (FP8 weights, bf16 KV), and
`bench_transfer.py` results transfer_bf16.json and transfer_fp8.json (bf16 and FP8 pools). A
missing result is a row that says so. With a miss among a model's decode rows, the device time
per kernel at batch 1 from its kernel log (`bench_engine.py --kernel-profile` output) is printed
above the table.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODELS = {"q7": "Qwen2.5-7B per-channel", "q3": "Qwen3-8B block"}
# Reported only when the suite ran them (PARTS=qm, ds): issue 22's FP8 experts and FP8
# DeepSeek (Moonlight-16B-A3B, the DeepSeek-V3 architecture), the same bars.
OPTIONAL_MODELS = {"qm": "Qwen3-30B-A3B block", "ds": "Moonlight-16B-A3B block"}
DECODE_FLOOR_RATIO = 1.25  # FP8 decode step / its floor, greedy, batch 1, 32, 128
DECODE_B1_SPEEDUP = 1.7  # bf16 step / FP8 step at batch 1
PREFILL_SPEEDUP = 1.45  # bf16 / FP8 prefill time, 2k and 8k tokens
THROUGHPUT_SPEEDUP = 1.6  # FP8 / bf16 output tokens/s, the offline workload
# FP8 / bf16 KV capacity with the same weights: 2x, less 1% for the activation peak the
# warm-up measures, which the pool's budget excludes and which differs between the two runs.
CAPACITY_SAME_WEIGHTS = 1.98
KV_BYTES_RATIO = 2.0  # bf16 / FP8 KV bytes per token, in the engine and on the wire
KERNEL_ROWS = 15


@dataclass(frozen=True)
class Check:
    """One target: `value` against `bar` by `op` ("<=" or ">="; None: reported, not judged)."""

    name: str
    value: float | None
    op: str | None = None
    bar: float | None = None

    def verdict(self) -> str:
        if self.value is None:
            return "no result"
        if self.op is None:
            return "-"
        if self.op == "<=":
            ok, off = self.value <= self.bar, self.value / self.bar - 1
        else:
            ok, off = self.value >= self.bar, 1 - self.value / self.bar
        return "PASS" if ok else f"MISS by {off:.1%}"

    def passed(self) -> bool | None:
        return None if self.value is None or self.op is None else self.verdict() == "PASS"


def load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _decode_row(result: dict | None, batch: int) -> dict | None:
    for r in (result or {}).get("decode") or []:
        if r["mix"] == "greedy" and r["overlap"] and r["batch"] == batch:
            return r
    return None


def _prefill_row(result: dict | None, tokens: int) -> dict | None:
    return next((r for r in (result or {}).get("prefill") or [] if r["tokens"] == tokens), None)


def _throughput(result: dict | None) -> float | None:
    rows = (result or {}).get("throughput") or {}
    runs = [r for name, r in rows.items() if name.startswith("ours_")]
    return max(runs, key=lambda r: r["requests"])["tokens_per_s"] if runs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _get(row: dict | None, key: str) -> float | None:
    return None if row is None else row.get(key)


def model_checks(label: str, bf16: dict | None, fp8: dict | None, w8: dict | None) -> list[Check]:
    checks = []
    for b in (1, 32, 128):
        ratio = _get(_decode_row(fp8, b), "ratio_to_floor")
        checks.append(
            Check(f"{label} decode b{b}: FP8 step / floor", ratio, "<=", DECODE_FLOOR_RATIO)
        )
    b1 = _ratio(_get(_decode_row(bf16, 1), "step_s"), _get(_decode_row(fp8, 1), "step_s"))
    checks.append(Check(f"{label} decode b1: bf16 / FP8 step", b1, ">=", DECODE_B1_SPEEDUP))
    for n in (2048, 8192):
        t = _ratio(_get(_prefill_row(bf16, n), "time_s"), _get(_prefill_row(fp8, n), "time_s"))
        name = f"{label} prefill {n // 1024}k: bf16 / FP8 time"
        checks.append(Check(name, t, ">=", PREFILL_SPEEDUP))
    if bf16 and fp8 and "throughput" in bf16 and "throughput" in fp8:
        tps = _ratio(_throughput(fp8), _throughput(bf16))
        checks.append(Check(f"{label} offline: FP8 / bf16 tok/s", tps, ">=", THROUGHPUT_SPEEDUP))
    engine = {
        name: (r or {}).get("engine") or {} for name, r in (("b", bf16), ("f", fp8), ("w", w8))
    }
    per_token = _ratio(engine["b"].get("kv_bytes_per_token"), engine["f"].get("kv_bytes_per_token"))
    checks.append(Check(f"{label} KV bytes/token: bf16 / FP8", per_token, ">=", KV_BYTES_RATIO))
    capacity = engine["f"].get("kv_capacity_tokens")
    if w8 is not None:
        same = _ratio(capacity, engine["w"].get("kv_capacity_tokens"))
        name = f"{label} KV tokens: FP8 / bf16 KV, FP8 weights"
        checks.append(Check(name, same, ">=", CAPACITY_SAME_WEIGHTS))
    both = _ratio(capacity, engine["b"].get("kv_capacity_tokens"))
    checks.append(Check(f"{label} KV tokens: all-FP8 / all-bf16", both, ">=", 2.0))
    return checks


def transfer_checks(bf16: dict | None, fp8: dict | None) -> list[Check]:
    """Bytes per token from the payloads that crossed (verified on arrival), and the receiver's
    DONE time at the largest token count both runs moved, over cuda_ipc (zmq in a CPU smoke
    run)."""
    per_token = time_ratio = None
    kind = "cuda_ipc"
    if bf16 and fp8:
        kind = next(
            (k for k in ("cuda_ipc", "zmq") if k in bf16["runs"] and k in fp8["runs"]), kind
        )
        rows = [{r["blocks"]: r for r in run["runs"].get(kind) or []} for run in (bf16, fp8)]
        common = sorted(set(rows[0]) & set(rows[1]))
        verified = all(r.get("verified") for side in rows for r in side.values())
        if common and verified:
            rb, rf = rows[0][common[-1]], rows[1][common[-1]]
            per_token = rb["bytes"] / rf["bytes"]  # the same blocks, so the same tokens
            time_ratio = _ratio(rf.get("recv_s"), rb.get("recv_s"))
    return [
        Check(f"KV bytes/transferred token: bf16 / FP8 ({kind})", per_token, ">=", KV_BYTES_RATIO),
        Check(f"KV transfer time, same tokens: FP8 / bf16 ({kind})", time_ratio),
    ]


def kernel_excerpt(log: str, batch: int = 1, rows: int = KERNEL_ROWS) -> str | None:
    """The kernel table `bench_engine.py --kernel-profile` printed for greedy decode at
    `batch`: its heading, column lines and top `rows` kernels."""
    lines = log.splitlines()
    head = f"decode loop at batch {batch} (greedy), device time per kernel"
    start = next((i for i, line in enumerate(lines) if line.startswith(head)), None)
    if start is None:
        return None
    return "\n".join(lines[start : start + 4 + rows])  # heading, rule, columns, rule


def report(results: Path, kernel_logs: Sequence[Path] = ()) -> tuple[list[Check], str]:
    checks, lines = [], []
    logs = {log.name.split("_")[0]: log for log in kernel_logs if log.exists()}
    for prefix, label in {**MODELS, **OPTIONAL_MODELS}.items():
        runs = [load(results / f"{prefix}_{kind}.json") for kind in ("bf16", "fp8", "w8")]
        if prefix in OPTIONAL_MODELS and not any(runs):
            continue
        ours = model_checks(label, *runs)
        checks += ours
        missed = any(c.passed() is False and "decode" in c.name for c in ours)
        excerpt = kernel_excerpt(logs[prefix].read_text()) if missed and prefix in logs else None
        if excerpt:
            lines += [f"{label}: a decode target missed; from {logs[prefix].name}:", excerpt, ""]
    transfers = [load(results / f"transfer_{kind}.json") for kind in ("bf16", "fp8")]
    checks += transfer_checks(*transfers)
    width = max(len(c.name) for c in checks)
    lines.append(f"{'target':<{width}}  {'measured':>8}  {'bar':>8}  verdict")
    for c in checks:
        value = "-" if c.value is None else f"{c.value:.3f}"
        bar = "" if c.op is None else f"{c.op} {c.bar:g}"
        lines.append(f"{c.name:<{width}}  {value:>8}  {bar:>8}  {c.verdict()}")
    return checks, "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--kernel-log", type=Path, action="append", default=[],
                    help="PREFIX_fp8.log: bench_engine.py output with --kernel-profile")  # fmt: skip
    args = ap.parse_args()
    _, text = report(args.results, args.kernel_log)
    for prefix in {**MODELS, **OPTIONAL_MODELS}:  # which ceilings each run measured
        for kind in ("bf16", "fp8", "w8"):
            ceil = (load(args.results / f"{prefix}_{kind}.json") or {}).get("ceilings")
            if ceil:
                fp8 = ceil.get("fp8_flops_per_s")
                print(
                    f"{prefix}_{kind}: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 "
                    f"{ceil['bf16_flops_per_s'] / 1e12:.0f}, fp8 "
                    f"{fp8 / 1e12 if fp8 else 0:.0f} TFLOP/s"
                )
    print(text)


if __name__ == "__main__":
    main()
