"""Two `bench_engine.py` results side by side (A: a reference run, B: the run to check): each
row's time and its ratio to the floor measured in that same run, and B's time over A's. The
check is on times: both runs share the machine, while each run's floors come from its own
ceiling measurement, which alone moves by a few percent between runs.

    python benchmarks/ab_compare.py A.json B.json [--tolerance 0.03]

Exit status 1 when some B time is worse than A's by more than the tolerance (noise included:
quote several runs before calling a miss)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(result: dict) -> dict[str, tuple[float, float | None]]:
    """name -> (seconds or tok/s, ratio to the run's floor; higher is worse) of every row."""
    out: dict[str, tuple[float, float | None]] = {}
    for r in result.get("decode") or []:
        loop = "overlapped" if r["overlap"] else "sync"
        out[f"decode {r['mix']} {loop} b{r['batch']}"] = (r["step_s"], r["ratio_to_floor"])
    for r in result.get("prefill") or []:
        out[f"prefill {r['tokens']}"] = (r["time_s"], r.get("ratio_to_floor"))
    for name, r in (result.get("throughput") or {}).items():
        # Throughput has no floor: its "ratio" is the inverse rate, so higher is worse too.
        out[f"throughput {name}"] = (r["tokens_per_s"], 1e4 / r["tokens_per_s"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--tolerance", type=float, default=0.03)
    args = ap.parse_args()
    a, b = (json.loads(p.read_text()) for p in (args.a, args.b))
    ra, rb = rows(a), rows(b)
    for name, run in (("A", a), ("B", b)):
        ceil = run.get("ceilings") or {}
        print(
            f"{name}: {args.a if name == 'A' else args.b}  copy "
            f"{ceil.get('copy_bytes_per_s', 0) / 1e12:.2f} TB/s, matmul "
            f"{ceil.get('bf16_flops_per_s', 0) / 1e12:.0f} TFLOP/s"
        )
    print(f"{'row':<34} {'A':>10} {'B':>10} {'A ratio':>8} {'B ratio':>8} {'B/A time':>9}")
    worse = []
    for name in [n for n in ra if n in rb]:
        (va, xa), (vb, xb) = ra[name], rb[name]
        unit = 1 if name.startswith("throughput") else 1e3
        rel = xb / xa if name.startswith("throughput") else vb / va
        flag = ""
        if rel is not None and rel > 1 + args.tolerance:
            flag = "  WORSE"
            worse.append(name)
        shown_a = f"x{xa:.2f}" if xa and not name.startswith("throughput") else "-"
        shown_b = f"x{xb:.2f}" if xb and not name.startswith("throughput") else "-"
        print(
            f"{name:<34} {va * unit:10.2f} {vb * unit:10.2f} {shown_a:>8} {shown_b:>8} "
            f"{rel:9.3f}{flag}"
        )
    print(f"{len(worse)} rows worse than A by more than {args.tolerance:.0%}: {worse}")
    raise SystemExit(1 if worse else 0)


if __name__ == "__main__":
    main()
