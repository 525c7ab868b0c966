"""Speculative decoding on one GPU (issue 21), through the engine's own step loop
(`LLMEngine.step` -> `EngineCore.step`: the real scheduler, verify rows replayed in the decode
CUDA graphs, `Sampler.verify`, KV rollback). Dummy weights of a real architecture (default
Qwen2.5-7B, bf16), token-id prompts; one target per process, shared by every engine
(`benchmarks/spec_harness.py`).

Parts (--parts, run in this order; --out is rewritten as each one ends):
- oracle: greedy output tok/s of whole requests (B at a time, joining and leaving) with
  speculation off (the default overlapped loop) and on with `OracleProposer`
  (`benchmarks/spec_oracle.py`) at --mean-accepted-length, K = --k. Random weights accept
  nothing, so the oracle drafts the off run's own output. Under --oracle-model context-free
  (default) every layer's o_proj and down_proj are zeroed for this part: the same shapes,
  bytes and kernels, so the same time, but the next token depends on the current one only, so
  bf16 differences between a B-row decode and a B(K+1)-row verify cannot flip a near-tie
  argmax and leave the reference (`as-is` keeps the weights; `off_track` counts those).
- verify: median step time with B decoding and `FixedDraftProposer` drafting exactly K, for
  each B and K, beside plain decode steps (synchronous and overlapped), with each point's floor.
- draft / eagle3: the real proposer (a random Qwen2.5-0.5B-config draft; a random EAGLE-3 head
  of the target's shape in its published layout, for a Llama target): step and propose time,
  tok/s against off (acceptance ~0 with random weights), and the catch-up: the first propose
  of a request after a --catchup-prompt prompt, against the target's prefill of it.
- sweep: the oracle at each K of --sweep-ks and batch of --sweep-batches, while --budget-s
  lasts.

    python benchmarks/bench_spec.py --out results/spec_q7.json                    # Qwen2.5-7B
    python benchmarks/bench_spec.py --model benchmarks/configs/llama-3.1-8b-instruct \\
        --parts eagle3 --out results/spec_l8.json
    python benchmarks/bench_spec.py --smoke --out /tmp/spec.json   # CPU, tiny configs
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import spec_models as sm  # noqa: E402
from benchmarks.outputs import args_record  # noqa: E402
from benchmarks.roofline import measure_ceilings  # noqa: E402
from benchmarks.spec_harness import Bench  # noqa: E402
from benchmarks.spec_oracle import FixedDraftProposer, OracleProposer  # noqa: E402
from benchmarks.spec_report import tables  # noqa: E402

PARTS = ("oracle", "verify", "draft", "eagle3", "sweep")
# --smoke: CPU, float32, tiny configs (written by the run) and sizes: every code path in seconds
SMOKE = dict(
    dtype="float32",
    device="cpu",
    kv_cache_memory_bytes=64 << 20,
    verify_batches=[1, 3],
    verify_ks=[1, 2],
    oracle_batches=[1, 3],
    method_batches=[1, 3],
    sweep_ks=[2],
    sweep_batches=[1, 3],
    context=24,
    steps=3,
    warmup=1,
    prompt_len=16,
    output_range=[10, 16],
    min_requests=2,
    catchup_prompt=40,
    catchup_requests=1,
    max_num_batched_tokens=256,
)


def oracle_point(bench: Bench, batch: int, k: int) -> dict[str, Any]:
    a = bench.args
    off = bench.off_run(batch, reference=True)
    engine = bench.engine("ngram", k)
    bench.warm(engine, batch, FixedDraftProposer(bench.vocab))
    tag = f"or{batch}k{k}"
    refs = {f"{tag}-{i}": out for i, out in enumerate(off["outputs"])}
    oracle = OracleProposer(refs, a.mean_accepted_length, k, bench.vocab, seed=100 * batch + k)
    engine.core.proposer = oracle
    on = bench.waves(engine, *bench.workload(batch), batch, tag)
    row = {
        "batch": batch,
        "k": k,
        "weights": bench.weights_state,
        "target_mean_accepted_length": a.mean_accepted_length,
        "alpha": oracle.alpha,
        "mean_accepted_length": on["spec"]["mean_accepted_length"] if on["spec"] else 1.0,
        "requests": on["requests"],
        "output_tokens": on["output_tokens"],
        "off_tokens_per_s": off["tokens_per_s"],
        "on_tokens_per_s": on["tokens_per_s"],
        "speedup": on["tokens_per_s"] / off["tokens_per_s"],
        "identical_outputs": sum(
            x == y for x, y in zip(on["outputs"], off["outputs"], strict=True)
        ),
        "off_track": len(oracle.off_track),
    }
    print(f"oracle b{batch} k{k}: {_short(row)}", flush=True)
    return row


def part_oracle(bench: Bench, result: dict[str, Any]) -> None:
    rows = result.setdefault("oracle", [])
    with bench.oracle_weights():
        for batch in bench.args.oracle_batches:
            rows.append(oracle_point(bench, batch, bench.args.k))


def part_sweep(bench: Bench, result: dict[str, Any]) -> None:
    rows = result.setdefault("oracle", [])
    with bench.oracle_weights():
        for k in bench.args.sweep_ks:
            for batch in bench.args.sweep_batches:
                if bench.over_budget():
                    result.setdefault("skipped", []).append(f"sweep b{batch} k{k}: budget")
                    continue
                rows.append(oracle_point(bench, batch, k))


def part_verify(bench: Bench, result: dict[str, Any], ceil: dict | None) -> None:
    rows = result.setdefault("verify", [])
    fixed = FixedDraftProposer(bench.vocab)
    for batch in bench.args.verify_batches:
        points = [(0, True), (0, False)] + [(k, False) for k in bench.args.verify_ks]
        for k, overlap in points:
            engine = bench.engine("ngram" if k else "none", k, overlap)
            if k:
                engine.core.proposer = fixed
            loop = "overlap" if overlap else "sync"
            row = {"batch": batch, "k": k, "loop": loop}
            row.update(bench.steady(engine, batch, k, f"v{batch}k{k}{loop}"))
            row["floor_s"] = bench.floor_s(batch * (k + 1), batch, row["mean_context"], ceil)
            rows.append(row)
            print(f"verify b{batch} k{k} {loop}: {_short(row)}", flush=True)


def part_method(bench: Bench, result: dict[str, Any], method: str) -> None:
    a, rows = bench.args, result.setdefault("methods", [])
    engine = bench.engine(method, a.k)
    for batch in a.method_batches:
        plain = bench.steady(bench.engine("none", 0), batch, 0, f"{method}p{batch}")
        spec = bench.steady(engine, batch, a.k, f"{method}s{batch}")
        off = bench.off_run(batch)
        bench.warm(engine, batch)
        on = bench.waves(engine, *bench.workload(batch), batch, f"{method}w{batch}")
        row = {
            "method": method,
            "batch": batch,
            "k": a.k,
            "plain_sync_step_s": plain["step_s"],
            "step_s": spec["step_s"],
            "propose_s": spec["propose_s"],
            "tokens_per_step": spec["tokens_per_step"],
            "mean_accepted_length": on["spec"]["mean_accepted_length"] if on["spec"] else 1.0,
            "off_tokens_per_s": off["tokens_per_s"],
            "on_tokens_per_s": on["tokens_per_s"],
            "speedup": on["tokens_per_s"] / off["tokens_per_s"],
        }
        rows.append(row)
        print(f"{method} b{batch}: {_short(row)}", flush=True)
    row = bench.catchup(engine, method)
    result.setdefault("catchup", []).append(row)
    print(f"{method} catch-up: {_short(row)}", flush=True)


def _short(row: dict[str, Any]) -> str:
    def show(key: str, value: Any) -> str:
        if isinstance(value, float) and key.endswith("_s") and not key.endswith("per_s"):
            return f"{key} {value * 1e3:.2f} ms"
        return f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"

    return ", ".join(show(k, v) for k, v in row.items() if v is not None)


def write_spec_models(args: argparse.Namespace, work: Path) -> dict[str, Path]:
    """The draft checkpoint and EAGLE-3 head the parts need, random, under `work`."""
    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    dtype = getattr(torch, args.dtype)
    target = sm.read_config(Path(args.model))
    out = {}
    if "draft" in args.parts:
        config = sm.TINY_QWEN_DRAFT if args.smoke else sm.QWEN25_05B
        out["draft"] = sm.write_draft(work / "draft", config, dtype, device)
    if "eagle3" in args.parts:
        if "LlamaForCausalLM" not in target.get("architectures", []):
            raise ValueError(
                f"--parts eagle3 needs a Llama target; {args.model} is {target.get('architectures')}"
            )
        vocab = sm.TINY_DRAFT_VOCAB if args.smoke else sm.EAGLE3_LLAMA31_8B_DRAFT_VOCAB
        out["eagle3"] = sm.write_eagle3_head(work / "eagle3", target, vocab, dtype, device)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=str(sm.CONFIGS / "qwen2.5-7b-instruct"),
                    help="target config dir (dummy weights)")  # fmt: skip
    ap.add_argument("--parts", nargs="+", default=["oracle", "verify", "draft", "sweep"],
                    choices=PARTS)  # fmt: skip
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--k", type=int, default=4, help="K of the oracle and method runs")
    ap.add_argument("--mean-accepted-length", type=float, default=3.0)
    ap.add_argument("--oracle-model", default="context-free", choices=["context-free", "as-is"])
    ap.add_argument("--verify-batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--verify-ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7])
    ap.add_argument("--oracle-batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--method-batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--sweep-ks", type=int, nargs="+", default=[2, 3, 5])
    ap.add_argument("--sweep-batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens of steady runs")
    ap.add_argument("--steps", type=int, default=20, help="timed steps of a steady run")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens of tok/s runs")
    ap.add_argument("--output-range", type=int, nargs=2, default=[192, 320])
    ap.add_argument("--waves", type=int, default=2, help="tok/s runs: batch x waves requests")
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--catchup-prompt", type=int, default=2048)
    ap.add_argument("--catchup-requests", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=12 << 30)
    ap.add_argument("--budget-s", type=float, default=0, help="skip sweep points past this")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny configs: the code paths")
    ap.add_argument("--out", default="benchmarks/results/spec.json")
    args = ap.parse_args(argv)
    if args.smoke:  # tiny defaults; flags given explicitly still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args(argv)
    if "draft" in args.parts and "eagle3" in args.parts:
        ap.error("draft and eagle3 need different targets: run them in two processes")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_spec_"))  # random checkpoints, removed at exit
    try:
        return run(args, out, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, out: Path, work: Path) -> dict[str, Any]:
    if args.smoke:
        tiny = sm.TINY_LLAMA_TARGET if "eagle3" in args.parts else sm.TINY_QWEN_TARGET
        args.model = str(sm.write_config(work / "target", tiny))
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "args": args_record(args),
        "ceilings": measure_ceilings() if args.device != "cpu" else None,
        "errors": {},
    }
    try:
        bench = Bench(args, write_spec_models(args, work))
    except Exception as exc:
        result["errors"]["setup"] = f"{type(exc).__name__}: {exc}"
        out.write_text(json.dumps(result, indent=1))
        raise
    result["engine"] = bench.info
    print("engine:", bench.info, flush=True)
    runs = {
        "oracle": lambda: part_oracle(bench, result),
        "verify": lambda: part_verify(bench, result, result["ceilings"]),
        "draft": lambda: part_method(bench, result, "draft"),
        "eagle3": lambda: part_method(bench, result, "eagle3"),
        "sweep": lambda: part_sweep(bench, result),
    }
    for part in (p for p in PARTS if p in args.parts):
        print(f"=== {part} ({time.monotonic() - bench.start:.0f}s)", flush=True)
        failed = False
        try:
            runs[part]()
        except Exception as exc:  # one part failing leaves the others' results
            traceback.print_exc()
            result["errors"][part] = f"{type(exc).__name__}: {exc}"
            failed = True
        result["off"] = [{k: v for k, v in r.items() if k != "outputs"} | {"batch": b}
                         for b, by_weights in bench.off_runs.items() for r in by_weights.values()]  # fmt: skip
        out.write_text(json.dumps(result, indent=1))
        if failed:
            bench.reset()
    print(f"wrote {out}")
    print(tables([result]))
    return result


if __name__ == "__main__":
    main()
