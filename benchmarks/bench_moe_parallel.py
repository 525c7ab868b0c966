"""Mixture-of-experts decode on one host: tensor parallel (every rank a slice of every expert),
expert parallel (every rank whole experts) and one GPU, through the decode node's real loop.

    python benchmarks/bench_moe_parallel.py --out benchmarks/results/moe_parallel  # 2 GPUs
    python benchmarks/bench_moe_parallel.py --smoke       # CPU, gloo, tiny Qwen3-MoE: code paths

Model: Qwen3-30B-A3B (benchmarks/configs/qwen3-30b-a3b, dummy weights, bf16): 48 layers of 128
experts, top-8. Each layout (TP 1, TP 2, EP 2) runs in a child process of its own (a process
joins one NCCL group), on the harness of bench_tp.py: a real `DecodeNode`
(`benchmarks/decode_loop.py`) at batch 32 and 128, greedy, requests finishing and joining.

Combine: attention is tensor parallel in both two-rank layouts, so every rank already holds
every token and no dispatch is needed; with EP a rank runs only the (token, expert) pairs of
its experts, with TP every pair on its slice; either way one all-reduce per MoE layer sums the
partial outputs (`common.model.layers.moe`). Each row says so, with the split it read from the
rank's layers. Floor of a step, per GPU: (the weights a step reads + the KV of every running
request) / copy bandwidth, plus the collectives' bytes / peer bandwidth as in bench_tp.py. At
batch B, routing top-k of E experts touches an expert with probability 1 - (1 - k/E)^B (87%
at 32, ~100% at 128, for uniform routing), which scales the experts' bytes.

Equality: fp32, the model cut to --check-layers layers (same layer shapes), greedy tokens of
TP 2 and EP 2 against TP 1.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from benchmarks.bench_tp import comm_bytes, devices, peer_bandwidth  # noqa: E402
from benchmarks.decode_loop import LoopDriver, build_node  # noqa: E402
from benchmarks.roofline import measure_ceilings, weight_bytes  # noqa: E402
from benchmarks.stack import pick_ports  # noqa: E402
from common import LLM, SamplingParams  # noqa: E402
from common.engine.config import EngineConfig  # noqa: E402
from common.engine.worker import Worker  # noqa: E402
from common.model.layers.moe import Experts  # noqa: E402

CONFIG = ROOT / "configs" / "qwen3-30b-a3b"
LAYOUTS = {"tp1": (1, False), "tp2": (2, False), "ep2": (2, True)}  # name -> (ranks, EP)
TINY = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "norm_topk_prob": True, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}  # fmt: skip


def moe_split(worker: Worker) -> dict:
    """How this rank's MoE layers are split, read from its first one, and how they combine."""
    experts = next(m for m in worker.model.modules() if isinstance(m, Experts))
    combine = "none (one rank)"
    if worker.tp.size > 1:
        combine = "one all_reduce per MoE layer (TP attention replicates tokens: no dispatch)"
    return {
        "experts_per_rank": len(experts.expert_range),
        "expert_intermediate_per_rank": experts.intermediate_size,
        "combine": combine,
    }


def step_weight_bytes(worker: Worker, batch: int) -> float:
    """Bytes of this rank's weights a decode step of `batch` tokens reads: every expert's
    with the probability that some token routes to it (uniform routing), the rest whole."""
    moe = worker.spec.moe
    touched = 1.0 - (1.0 - moe.top_k / moe.num_experts) ** batch
    expert = sum(
        p.numel() * p.element_size()
        for m in worker.model.modules()
        if isinstance(m, Experts)
        for p in m.parameters()
    )
    return weight_bytes(worker.model) - expert * (1.0 - touched)


def bench_layout(args, name: str, ceil: dict | None, peer: float | None) -> list[dict]:
    tp, ep = LAYOUTS[name]
    engine = EngineConfig.from_options(
        model=args.model, load_format="dummy", dtype=args.dtype, tp=tp,
        enable_expert_parallel=ep, device=devices(tp, not args.smoke),
        max_num_seqs=max(args.batches), max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False, num_kv_blocks=args.num_kv_blocks,
    )  # fmt: skip
    worker = Worker(engine)
    node, drain, prefill = build_node(engine, worker, pick_ports()[1])
    rows = []
    try:
        worker.kv_cache.pool.normal_()  # rank 0's heads; the ranks attend over zeros
        kv_token = worker.rank_spec.kv_bytes_per_token(worker.kv_cache.pool.element_size())
        split = moe_split(worker)
        driver = LoopDriver(node, prefill, args.context, args.min_new, args.max_new)
        for batch in args.batches:
            r = driver.run(batch, args.steps, args.warmup)
            if args.kernel_profile:  # rank 0's kernels (the all-reduces among them)
                print(f"{name} rank 0 at batch {batch}, {driver.kernel_profile(batch, 20)}")
            driver.drain()
            row = {"layout": name, "tp": tp, "expert_parallel": ep, **split, "batch": batch,
                   "context": args.context, "step_s": r.step_s, "mean_running": r.mean_running,
                   "mean_context": r.mean_context}  # fmt: skip
            if ceil is not None:
                kv = r.mean_running * r.mean_context * kv_token
                row["hbm_floor_s"] = (step_weight_bytes(worker, batch) + kv) / ceil[
                    "copy_bytes_per_s"
                ]
                row["comm_floor_s"] = comm_bytes(worker, batch) / peer if peer and tp > 1 else 0.0
                row["floor_s"] = row["hbm_floor_s"] + row["comm_floor_s"]
                row["ratio_to_floor"] = r.step_s / row["floor_s"]
            rows.append(row)
            print("decode loop:", row, flush=True)
    finally:
        drain.stop()
        node.admission.close()
        node.channel.close()
        worker.close()
    return rows


def greedy_tokens(args, name: str) -> list[list[int]]:
    tp, ep = LAYOUTS[name]
    params = SamplingParams(temperature=0, max_tokens=args.check_tokens, ignore_eos=True)
    prompts = [[100 + (7 * i + j) % 400 for j in range(n)] for i, n in enumerate((5, 33, 130))]
    with LLM(args.check_model, load_format="dummy", dtype="float32", tp=tp,
             enable_expert_parallel=ep, device=devices(tp, not args.smoke),
             num_kv_blocks=args.num_kv_blocks or 256, max_num_seqs=4) as llm:  # fmt: skip
        return [o.token_ids for o in llm.generate(prompts, params)]


def check_equality(args) -> dict:
    tokens = {name: in_child(greedy_tokens, args, name) for name in LAYOUTS}
    config = json.loads((Path(args.check_model) / "config.json").read_text())
    result = {"layers": config["num_hidden_layers"]}
    for name in ("tp2", "ep2"):
        first = [first_difference(x, y) for x, y in zip(tokens["tp1"], tokens[name], strict=True)]
        result[name] = {"equal": tokens[name] == tokens["tp1"], "first_difference": first}
    print("greedy vs TP 1 (fp32):", result, flush=True)
    return result


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def in_child(fn, *args):
    """`fn(*args)` in a spawned process: a process joins one NCCL group only (groups whose
    collectives were captured in graphs are never destroyed: `TPGroup.close`)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_run_into, args=(results, fn, args))
    child.start()
    try:
        return results.get(timeout=1800)  # a child that died raises queue.Empty here
    finally:
        child.join(timeout=60)


def _run_into(results, fn, args) -> None:
    results.put(fn(*args))


def cut_layers(model: str, layers: int) -> str:
    """A config directory of `model` with only its first `layers` layers."""
    config = json.loads((Path(model) / "config.json").read_text())
    config["num_hidden_layers"] = min(layers, config["num_hidden_layers"])
    folder = Path(tempfile.mkdtemp(prefix="bench_moe_check_"))
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def print_table(rows: list[dict], check: dict | None) -> None:
    print(f"\n{'layout':>6} {'batch':>6} {'experts/rank':>12} {'step ms':>8} {'floor ms':>9} "
          f"{'ratio':>6}  combine")  # fmt: skip
    for r in rows:
        f = r.get("floor_s")
        print(f"{r['layout']:>6} {r['batch']:>6} {r['experts_per_rank']:>12} "
              f"{r['step_s'] * 1e3:8.2f} {(f or 0) * 1e3:9.2f} "
              f"{r['step_s'] / f if f else float('nan'):6.2f}  {r['combine']}")  # fmt: skip
    if check is not None:
        for name in ("tp2", "ep2"):
            print(f"greedy TP1 == {name} (fp32, {check['layers']} layers): {check[name]['equal']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(CONFIG), help="config dir (dummy weights)")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of each request")
    ap.add_argument("--min-new", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--check-layers", type=int, default=4, help="layers of the fp32 check")
    ap.add_argument("--check-tokens", type=int, default=32, help="greedy tokens compared")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--kernel-profile", action="store_true", help="rank 0's device time per kernel")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny sizes")
    ap.add_argument("--out", default="benchmarks/results/moe_parallel")
    args = ap.parse_args(argv)
    if args.smoke:
        folder = Path(tempfile.mkdtemp(prefix="bench_moe_"))
        (folder / "config.json").write_text(json.dumps(TINY))
        args.model, args.dtype, args.batches, args.context = str(folder), "float32", [2, 4], 20
        args.min_new, args.max_new, args.steps, args.warmup = 4, 8, 5, 2
        args.num_kv_blocks, args.check_tokens, args.max_num_batched_tokens = 64, 6, 256
    args.check_model = cut_layers(args.model, args.check_layers)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.time()
    ceil = None if args.smoke else measure_ceilings()
    peer = None if args.smoke else peer_bandwidth()
    print("ceilings:", ceil, "peer copy bytes/s:", peer, flush=True)
    check = None if args.no_check else check_equality(args)
    rows = [row for name in args.layouts for row in in_child(bench_layout, args, name, ceil, peer)]
    result = {"model": args.model, "ceilings": ceil, "peer_bytes_per_s": peer, "decode": rows,
              "equality": check, "seconds": time.time() - started}  # fmt: skip
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print_table(rows, check)
    return result


if __name__ == "__main__":
    main()
