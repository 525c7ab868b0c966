"""The tables of `benchmarks/bench_spec.py` results and the issue-21 targets: at a mean accepted
length of 3 (the oracle, K = 4), output tok/s with speculation on / off >= 2.2 at batch 1 and
>= 1.6 at batch 32. A speedup counts only when the run's measured mean accepted length is
within MEAN_TOLERANCE of the one asked for.

    python benchmarks/spec_report.py RESULT.json [RESULT.json ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

SPEEDUP_BARS = {1: 2.2, 32: 1.6}  # batch -> oracle tok/s on / off at mean accepted length 3
TARGET_MEAN = 3.0
TARGET_K = 4
MEAN_TOLERANCE = 0.15

Result = dict[str, Any]


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _grid(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]


def verify_table(result: Result) -> list[str]:
    """Per batch: the plain step (overlapped, synchronous), then each K's verify step with its
    ratio to the synchronous plain step, its floor in brackets."""
    rows = result.get("verify") or []
    if not rows:
        return []
    ks = sorted({r["k"] for r in rows if r["k"]})
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        at = {(r["k"], r["loop"]): r for r in rows if r["batch"] == batch}
        sync = at.get((0, "sync"))
        line = [str(batch), ms((at.get((0, "overlap")) or {}).get("step_s")),
                ms(sync and sync["step_s"])]  # fmt: skip
        for k in ks:
            r = at.get((k, "sync"))
            ratio = r["step_s"] / sync["step_s"] if r and sync else None
            line.append(
                "-" if r is None else f"{ms(r['step_s'])} x{ratio:.2f} [{ms(r['floor_s'])}]"
            )
        out.append(line)
    header = ["batch", "off ovl", "off sync", *(f"K={k}" for k in ks)]
    title = "verify step ms, x the synchronous plain step [floor ms]"
    return [title, *_grid(header, out)]


def oracle_verdict(row: Result) -> str:
    bar = SPEEDUP_BARS.get(row["batch"])
    if bar is None or row["k"] != TARGET_K or row["target_mean_accepted_length"] != TARGET_MEAN:
        return "-"
    if abs(row["mean_accepted_length"] - TARGET_MEAN) > MEAN_TOLERANCE:
        return f"no verdict: mean accepted {row['mean_accepted_length']:.2f}"
    if row["speedup"] >= bar:
        return f"PASS (>= {bar})"
    return f"MISS by {1 - row['speedup'] / bar:.1%} (>= {bar})"


def oracle_table(result: Result) -> list[str]:
    rows = result.get("oracle") or []
    if not rows:
        return []
    body = [
        [str(r["batch"]), str(r["k"]), f"{r['mean_accepted_length']:.2f}",
         f"{r['off_tokens_per_s']:.0f}", f"{r['on_tokens_per_s']:.0f}", f"x{r['speedup']:.2f}",
         f"{r['identical_outputs']}/{r['requests']}", oracle_verdict(r)]
        for r in sorted(rows, key=lambda r: (r["batch"], r["k"]))
    ]  # fmt: skip
    header = ["batch", "K", "accepted", "off tok/s", "on tok/s", "on/off", "same", "verdict"]
    weights = rows[0].get("weights")
    title = f"oracle drafts (weights {weights}), mean accepted length asked {rows[0]['target_mean_accepted_length']}"  # fmt: skip
    return [title, *_grid(header, body)]


def method_table(result: Result) -> list[str]:
    """Per method and batch: the plain synchronous step, the verify step of as many fixed
    drafts (the verify part, when it ran), the method's step and its propose time."""
    rows = result.get("methods") or []
    if not rows:
        return []
    fixed = {(r["batch"], r["k"]): r["step_s"] for r in result.get("verify") or [] if r["k"]}
    body = [
        [r["method"], str(r["batch"]), str(r["k"]), ms(r["plain_sync_step_s"]),
         ms(fixed.get((r["batch"], r["k"]))), ms(r["step_s"]), ms(r["propose_s"]),
         f"{r['mean_accepted_length']:.2f}", f"{r['off_tokens_per_s']:.0f}",
         f"{r['on_tokens_per_s']:.0f}", f"x{r['speedup']:.2f}"]
        for r in rows
    ]  # fmt: skip
    header = ["method", "batch", "K", "off sync ms", "verify ms", "step ms", "propose ms",
              "accepted", "off tok/s", "on tok/s", "on/off"]  # fmt: skip
    return ["draft methods (random weights: acceptance ~0)", *_grid(header, body)]


def catchup_table(result: Result) -> list[str]:
    rows = result.get("catchup") or []
    if not rows:
        return []
    body = []
    for r in rows:
        extra = r["first_propose_s"] - r["later_propose_s"]
        body.append([r["method"], str(r["prompt_tokens"]), ms(r["target_prefill_s"]),
                     ms(r["first_propose_s"]), ms(r["later_propose_s"]),
                     f"{ms(extra)} (x{extra / r['target_prefill_s']:.2f})"])  # fmt: skip
    header = ["method", "prompt", "target prefill ms", "first propose ms", "later ms",
              "catch-up ms (x prefill)"]  # fmt: skip
    return [
        "catch-up: the first propose computes the prompt for the proposer",
        *_grid(header, body),
    ]


def tables(results: list[Result]) -> str:
    lines: list[str] = []
    for result in results:
        engine, ceil = result.get("engine") or {}, result.get("ceilings")
        lines.append(f"== {engine.get('model', '?')} on {result.get('gpu')}")
        if ceil:
            lines.append(
                f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
                f"{ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s"
            )
        for table in (oracle_table, verify_table, method_table, catchup_table):
            block = table(result)
            if block:
                lines += [*block, ""]
        for part, error in (result.get("errors") or {}).items():
            lines.append(f"part {part} FAILED: {error}")
        for skipped in result.get("skipped") or []:
            lines.append(f"skipped {skipped}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, nargs="+")
    args = ap.parse_args()
    results = [json.loads(p.read_text()) for p in args.results if p.exists()]
    missing = [str(p) for p in args.results if not p.exists()]
    print(tables(results))
    if missing:
        print("no result:", ", ".join(missing))


if __name__ == "__main__":
    main()
