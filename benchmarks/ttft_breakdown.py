"""Where TTFT goes, phase by phase, in PD mode (cuda_ipc and zmq KV transport) and colocated,
through the HTTP router, each setup started with scripts/launch_pd.sh and stopped after it.

    python benchmarks/ttft_breakdown.py [--setups pd_cuda_ipc pd_zmq colocated] \\
        [--lengths 128 512 2048 8192] [--repeats 3] [--out benchmarks/results/ttft_breakdown]
    python benchmarks/ttft_breakdown.py --model '' --lengths 32 128   # CPU: embedded SmolLM2
    python benchmarks/ttft_breakdown.py --replot benchmarks/results/ttft_breakdown/ttft.json

Default model: dummy weights of Qwen2.5-7B (benchmarks/configs/qwen2.5-7b-instruct, no
tokenizer, so prompts are token ids). Idle system, one request at a time: per prompt length one
untimed warm-up, then --repeats requests with distinct random prompts (fixed seed; no prefix
cache hits), max_tokens 8, ignore_eos, streamed with `logprobs: 0` so that every token is a
chunk even without a tokenizer. Reported: medians of the client-measured TTFT and of the timing
record the router returns. The check: the sum of the TTFT phases (router_queue_tokenize +
router_encode + node_decode + prefill_queue + prefill_compute + first_token_delivery, see
router/timing.py) against the router's ttft (it holds by construction: first_token_delivery is
what is left of the router's wait once the node's measured phases are taken out: socket
transit and the event loop) and against the client's TTFT (which also holds HTTP, JSON and SSE
time the router cannot see), PASS within 5%.

kv_transfer and kv_transfer_exposed are NOT phases of TTFT here: the prefill node sends the
first token to the router before the KV transfer completes; the exposed part of the transfer
(KV landed after the first token was sampled) delays the first decode interval instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the repository's packages

from benchmarks.loadgen.client import RequestResult, Target, send  # noqa: E402
from benchmarks.outputs import args_record, publish, pyplot  # noqa: E402
from benchmarks.stack import (  # noqa: E402
    PDStack,
    add_model_args,
    resolve_load_format,
    same_python_env,
)
from pdserve.workload.datasets import RequestSpec  # noqa: E402
from router.timing import TTFT_PHASES  # noqa: E402

# Prefill on GPU 0, decode on GPU 1 (launch_pd.sh pins with --device cuda:N and leaves every
# GPU visible, so the prefill node can open the decode pool through CUDA IPC). Which path a run
# took is read from the prefill node's log ("kv_routes").
PINNED = ("--prefill-gpus", "0", "--decode-gpus", "1")
SETUPS: dict[str, tuple[str, ...]] = {
    "pd_cuda_ipc": ("--transport", "cuda_ipc", *PINNED),
    "pd_zmq": ("--transport", "zmq", *PINNED),
    "colocated": ("--colocated", "--decode-gpus", "0"),
}
DEFAULT_SETUPS = ["pd_cuda_ipc", "pd_zmq", "colocated"]

AFTER_FIRST = ("kv_transfer", "kv_transfer_exposed", "decode_admission_wait")
KEYS = ("client_ttft", "ttft", *TTFT_PHASES, "phase_sum", *AFTER_FIRST, "first_gap", "client_e2e")
TOLERANCE = 0.05
CAPTION = (
    "kv_transfer / kv_transfer_exposed are not part of TTFT: the first token leaves the prefill "
    "node before the KV transfer completes;\nthe exposed part (KV landing after the first token) "
    "lengthens the first decode interval. Hatched: kv_transfer_exposed, drawn after TTFT."
)


def launch_args(setup: str, args: argparse.Namespace) -> list[str]:
    budget = str(max(8192, *args.lengths))  # a whole prompt in one prefill step
    out = [*SETUPS[setup], "--health-timeout", str(args.health_timeout)]
    for role in ("prefill", "decode"):
        out += [f"--{role}-max-num-batched-tokens", budget, f"--{role}-kv-memory-fraction", "0.8"]
        if args.load_format != "auto":
            out += [f"--{role}-load-format", args.load_format]
    out += ["--decode-max-num-seqs", "16"]  # requests come one at a time: fewer graphs to capture
    return out + (["--model", args.model] if args.model else [])


# -- measuring ----------------------------------------------------------------------------------


def request_record(response: RequestResult) -> dict[str, Any]:
    if not response.success:
        raise RuntimeError(f"request failed: {response.error}")
    timing = response.timing or {}
    record = {k: timing.get(k) for k in ("ttft", *TTFT_PHASES, *AFTER_FIRST)}
    record["client_ttft"], record["client_e2e"] = response.ttft, response.e2e
    record["first_gap"] = response.itl[0] if response.itl else None  # client-side
    record["tokens"] = response.output_tokens
    missing = [k for k in TTFT_PHASES if record[k] is None]
    record["phase_sum"] = None if missing else sum(record[k] for k in TTFT_PHASES)
    return record


def summarize(length: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"length": length, "requests": records}
    for key in KEYS:
        values = [r[key] for r in records if r[key] is not None]
        row[key] = statistics.median(values) if values else None
    for against in ("ttft", "client_ttft"):  # median over requests of sum / ttft - 1
        errors = [r["phase_sum"] / r[against] - 1 for r in records if r["phase_sum"] is not None]
        error = statistics.median(errors) if len(errors) == len(records) else None
        row[f"sum_vs_{against}"] = error
        row[f"pass_vs_{against}"] = error is not None and abs(error) <= TOLERANCE
    return row


async def measure(url: str, model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    target = Target(url, model)
    rows = []
    async with httpx.AsyncClient(timeout=600) as client:
        for length in args.lengths:
            prompts = [
                RequestSpec(
                    args.max_tokens, tuple(rng.randrange(100, 30000) for _ in range(length))
                )
                for _ in range(1 + args.repeats)
            ]
            await send(client, target, prompts[0], RequestResult(0, 0.0))  # warm-up
            records = []
            for prompt in prompts[1:]:
                response = await send(client, target, prompt, RequestResult(0, 0.0))
                records.append(request_record(response))
                r = records[-1]
                print(
                    f"    {length:>6} tokens: client TTFT {_ms(r['client_ttft'])} ms, router "
                    f"{_ms(r['ttft'])} ms, phase sum {_ms(r['phase_sum'])} ms, "
                    f"kv_transfer_exposed {_ms(r['kv_transfer_exposed'])} ms",
                    flush=True,
                )
            rows.append(summarize(length, records))
    return rows


def run_setup(setup: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    launch = launch_args(setup, args)
    print(f"== {setup}: launch_pd.sh {' '.join(launch)}", flush=True)
    started = time.monotonic()
    log_path = args.out / f"{setup}.log"
    stack = PDStack(*launch, log_path=log_path, start_timeout_s=args.health_timeout + 60, env=env)
    try:
        print(f"   healthy after {time.monotonic() - started:.0f} s ({stack.url})", flush=True)
        model = stack.get("/v1/models")[1]["data"][0]["id"]
        rows = asyncio.run(measure(stack.url, model, args))
    finally:
        left = stack.stop()
        print(f"   stopped{'; STILL ALIVE: ' + str(left) if left else ''}", flush=True)
    routes = [  # the cuda_ipc sender logs, per receiver, whether it writes directly or not
        line.split("cuda_ipc: ", 1)[1]
        for line in log_path.read_text().splitlines()
        if "cuda_ipc: KV to" in line
    ]
    return {"launch_args": launch, "model": model, "rows": rows, "kv_routes": routes}


# -- reporting ----------------------------------------------------------------------------------


def _ms(value: float | None, width: int = 0) -> str:
    return f"{value * 1e3:>{width}.1f}" if value is not None else f"{'-':>{width}}"


def _pct(value: float | None) -> str:
    return f"{value:+6.1%}" if value is not None else f"{'-':>6}"


def print_table(result: dict[str, Any]) -> None:
    args, w = result["args"], max(8, *(len(s) for s in result["setups"]))
    print(f"\nmedians (ms) of {args['repeats']} requests, max_tokens {args['max_tokens']}")
    print("TTFT = rq_tok + r_enc + n_dec + p_queue + p_comp + ft_del. kv_xfer and exposed are")
    print("NOT in TTFT: the exposed transfer delays the first decode interval (gap1, client-side).")
    print(
        f"{'setup':<{w}} {'len':>5} {'client':>7} {'router':>7} {'rq_tok':>6} {'r_enc':>6} "
        f"{'n_dec':>6} {'p_queue':>7} "
        f"{'p_comp':>7} {'ft_del':>6} {'sum':>7} {'sum/router':>15} {'sum/client':>15} "
        f"{'kv_xfer':>7} {'exposed':>7} {'gap1':>6}"
    )
    for setup, data in result["setups"].items():
        if "error" in data:
            print(f"{setup:<{w}} FAILED: {data['error'].splitlines()[0]}")
            continue
        for row in data["rows"]:
            checks = [
                f"{_pct(row[f'sum_vs_{k}'])} {'PASS' if row[f'pass_vs_{k}'] else 'FAIL'}"
                for k in ("ttft", "client_ttft")
            ]
            print(
                f"{setup:<{w}} {row['length']:>5} {_ms(row['client_ttft'], 7)} "
                f"{_ms(row['ttft'], 7)} {_ms(row['router_queue_tokenize'], 6)} "
                f"{_ms(row['router_encode'], 6)} {_ms(row['node_decode'], 6)} "
                f"{_ms(row['prefill_queue'], 7)} {_ms(row['prefill_compute'], 7)} "
                f"{_ms(row['first_token_delivery'], 6)} {_ms(row['phase_sum'], 7)} "
                f"{checks[0]:>15} {checks[1]:>15} {_ms(row['kv_transfer'], 7)} "
                f"{_ms(row['kv_transfer_exposed'], 7)} {_ms(row['first_gap'], 6)}"
            )
    for setup, data in result["setups"].items():
        for route in data.get("kv_routes", []):
            warn = "" if "straight into its pool" in route else "WARNING, NOT the CUDA IPC path: "
            print(f"{setup} KV route: {warn}{route}")
    for line in result["summary"]["lines"]:
        print(line)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """PD cuda_ipc TTFT / colocated TTFT and exposed transfer / TTFT, at 2048 tokens (or the
    length closest to it)."""
    lengths = result["args"]["lengths"]
    length = min(lengths, key=lambda n: abs(n - 2048))
    rows = {
        setup: next(r for r in data["rows"] if r["length"] == length)
        for setup, data in result["setups"].items()
        if "rows" in data
    }
    out: dict[str, Any] = {"length": length, "lines": [f"\nat {length} tokens:"]}
    ipc, col = rows.get("pd_cuda_ipc"), rows.get("colocated")
    if ipc and col and ipc["ttft"] and col["ttft"]:
        for key in ("ttft", "client_ttft"):
            out[f"pd_cuda_ipc_over_colocated_{key}"] = ratio = ipc[key] / col[key]
            out["lines"].append(f"  PD cuda_ipc / colocated {key}: {ratio:.3f}")
    for setup, row in rows.items():
        if setup.startswith("pd_") and row["kv_transfer_exposed"] is not None and row["ttft"]:
            share = row["kv_transfer_exposed"] / row["ttft"]
            out[f"{setup}_exposed_over_ttft"] = share
            target = "meets" if share <= 0.05 else "MISSES"
            out["lines"].append(
                f"  {setup}: kv_transfer_exposed / TTFT = {share:.2%} ({target} the <= 5% target); "
                f"kv_transfer {_ms(row['kv_transfer'])} ms"
            )
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        print(f"matplotlib is not installed: no plot; later: --replot {path.with_suffix('.json')}")
        return
    setups = [s for s, d in result["setups"].items() if "rows" in d]
    lengths = result["args"]["lengths"]
    fig, axes = plt.subplots(
        1, len(lengths), figsize=(max(10, 3 * len(lengths) + 3), 5.5), squeeze=False
    )
    colors = dict(zip(TTFT_PHASES, ("C7", "C5", "C4", "C1", "C0", "C2"), strict=True))
    for ax, length in zip(axes[0], lengths, strict=True):
        for x, setup in enumerate(setups):
            row = next(r for r in result["setups"][setup]["rows"] if r["length"] == length)
            bottom = 0.0
            for phase in TTFT_PHASES:
                height = (row[phase] or 0.0) * 1e3
                ax.bar(x, height, 0.6, bottom=bottom, color=colors[phase], label=phase)
                bottom += height
            exposed = (row["kv_transfer_exposed"] or 0.0) * 1e3
            if row["kv_transfer_exposed"] is not None:
                ax.bar(
                    x,
                    exposed,
                    0.3,
                    bottom=bottom,
                    color="none",
                    edgecolor="C3",
                    hatch="///",
                    label="kv_transfer_exposed (after TTFT)",
                )
            ax.plot(x, row["client_ttft"] * 1e3, "kD", label="client TTFT")
            note = (
                f"xfer {_ms(row['kv_transfer'])} ms\nexposed {_ms(row['kv_transfer_exposed'])} ms"
            )
            top = max(bottom + exposed, row["client_ttft"] * 1e3)
            ax.annotate(
                note if row["kv_transfer"] is not None else "",
                (x, top),
                ha="center",
                va="bottom",
                fontsize=7,
                xytext=(0, 3),
                textcoords="offset points",
            )
        ax.set_xticks(range(len(setups)), setups, rotation=20, fontsize=8)
        ax.set_title(f"{length} tokens", fontsize=10)
        ax.margins(y=0.18)
    axes[0][0].set_ylabel("ms (median)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    fig.legend(unique.values(), unique.keys(), loc="center right", fontsize=7)
    fig.suptitle(
        f"TTFT by phase (median), {result['model_label']}\n"
        "the KV transfer is not part of TTFT: it overlaps prefill and the first decode interval",
        fontsize=10,
    )
    fig.text(0.01, 0.01, CAPTION, fontsize=7)
    fig.tight_layout(rect=(0, 0.07, 0.8, 0.93))
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# -- main ---------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--setups", nargs="+", choices=list(SETUPS), default=DEFAULT_SETUPS)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    add_model_args(ap, "model directory; '' = the embedded SmolLM2 (CPU runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/ttft_breakdown")
    ap.add_argument("--replot", type=Path, help="only redraw the plot and table of a JSON result")
    args = ap.parse_args()
    resolve_load_format(args)
    if args.repeats < 1 or min(args.lengths) < 1:
        ap.error("--repeats and every length must be >= 1")
    return args


def main() -> None:
    args = parse_args()
    if args.replot:
        result = json.loads(args.replot.read_text())
        result.setdefault("summary", summary(result))  # a run cut short wrote none
        plot(result, args.replot.with_suffix(".png"))
        print_table(result)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    name = Path(args.model).name if args.model else "embedded SmolLM2-135M"
    result: dict[str, Any] = {
        "args": args_record(args),
        "model_label": f"{name} ({args.load_format} weights)",
        "setups": {},
    }
    path = args.out / "ttft.json"
    with tempfile.TemporaryDirectory(prefix="pdserve-python-") as shim:
        env = same_python_env(Path(shim))  # the stack runs with this very interpreter
        for setup in args.setups:
            try:
                result["setups"][setup] = run_setup(setup, args, env)
            except Exception as exc:  # one setup failing to start must not lose the others
                print(f"   {setup} FAILED: {exc}", flush=True)
                result["setups"][setup] = {"error": f"{type(exc).__name__}: {exc}"}
            path.write_text(json.dumps(result, indent=1))  # partial results survive a timeout
    result["summary"] = summary(result)
    publish(result, path, plot, print_table)


if __name__ == "__main__":
    main()
