"""Tensor parallel on one host: the decode node's real loop at TP n against its floor, and
greedy equality of TP n with TP 1.

    python benchmarks/bench_tp.py --out benchmarks/results/tp        # 2 GPUs, Qwen2.5-7B dummy
    python benchmarks/bench_tp.py --smoke                            # CPU, tiny model: code paths

Decode: a real `DecodeNode` (`benchmarks/decode_loop.py`) whose Worker has `tp` ranks (rank 0
here, the others its processes) at batch 32 and 128, greedy, requests finishing and joining.
Floor of a step, per GPU: (its half of the weights + its KV heads of every running request) /
copy bandwidth of GPU 0, plus the bytes each GPU sends in the step's collectives (2 all-reduces
per layer and one for the embedding, of batch x hidden activations: a ring all-reduce sends
(n-1)/n x 2 x size per GPU; the logits gather sends its vocabulary rows) / the peer copy
bandwidth GPU 0 -> GPU 1 (NVLink). Latency of the ~2 x layers small collectives is not in the
floor: at batch 32 it is what separates the step from it.

Equality: fp32, the same dummy weights at TP 1 (GPU 0) and TP n (GPUs 0..n-1), greedy tokens
of a few prompts compared token for token (CUDA graphs on: the all-reduces are captured).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from benchmarks.bench_engine import CONFIG  # noqa: E402
from benchmarks.decode_loop import LoopDriver, build_node  # noqa: E402
from benchmarks.roofline import measure_ceilings, time_fn, weight_bytes  # noqa: E402
from benchmarks.stack import pick_ports  # noqa: E402
from common import LLM, SamplingParams  # noqa: E402
from common.engine.config import EngineConfig  # noqa: E402
from common.engine.worker import Worker  # noqa: E402

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}  # fmt: skip


def devices(tp: int, cuda: bool) -> str:
    return "cuda:" + ",".join(map(str, range(tp))) if cuda else "cpu"


def peer_bandwidth() -> float | None:
    """Bytes/s of a 1 GiB copy GPU 0 -> GPU 1."""
    if torch.cuda.device_count() < 2:
        return None
    pair = [torch.empty(1 << 29, dtype=torch.bfloat16, device=f"cuda:{i}") for i in (0, 1)]
    seconds = time_fn(lambda: pair[1].copy_(pair[0]), 10, True)
    pair.clear()
    torch.cuda.empty_cache()  # GPU 1 belongs to rank 1's KV pool
    return (1 << 29) * 2 / seconds


def comm_bytes(worker: Worker, batch: int) -> int:
    """Bytes one GPU sends in a decode step's collectives (see the module docstring)."""
    n, spec = worker.tp.size, worker.spec
    act = batch * spec.hidden_size * worker.kv_cache.pool.element_size()
    all_reduces = (2 * spec.num_layers + 1) * 2 * (n - 1) / n * act
    logits = batch * (-(-spec.vocab_size // n)) * worker.kv_cache.pool.element_size()
    return int(all_reduces + (n - 1) * logits)


def bench_decode(args, ceil: dict | None, peer: float | None) -> list[dict]:
    engine = EngineConfig.from_options(
        model=args.model, load_format="dummy", dtype=args.dtype, tp=args.tp,
        device=devices(args.tp, not args.smoke), max_num_seqs=max(args.batches),
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
        num_kv_blocks=args.num_kv_blocks,
    )  # fmt: skip
    worker = Worker(engine)
    node, drain, prefill = build_node(engine, worker, pick_ports()[1])
    rows = []
    try:
        worker.kv_cache.pool.normal_()  # rank 0's heads; the ranks attend over zeros
        kv_token = worker.rank_spec.kv_bytes_per_token(worker.kv_cache.pool.element_size())
        wbytes = weight_bytes(worker.model)
        driver = LoopDriver(node, prefill, args.context, args.min_new, args.max_new)
        for batch in args.batches:
            r = driver.run(batch, args.steps, args.warmup)
            if args.kernel_profile:  # rank 0's kernels, apart from the timed run
                print(f"rank 0 at batch {batch}, {driver.kernel_profile(batch, 20)}", flush=True)
            driver.drain()
            row = {"tp": args.tp, "batch": batch, "context": args.context, "step_s": r.step_s,
                   "mean_running": r.mean_running, "mean_context": r.mean_context}  # fmt: skip
            if ceil is not None and peer is not None:
                hbm = (wbytes + r.mean_running * r.mean_context * kv_token) / ceil[
                    "copy_bytes_per_s"
                ]
                comm = comm_bytes(worker, batch) / peer
                row.update(hbm_floor_s=hbm, comm_floor_s=comm, floor_s=hbm + comm)
                row["ratio_to_floor"] = r.step_s / row["floor_s"]
            rows.append(row)
            print("decode loop:", row, flush=True)
    finally:
        drain.stop()
        node.admission.close()
        node.channel.close()
        worker.close()
    return rows


def greedy_tokens(args, tp: int) -> list[list[int]]:
    cuda = not args.smoke
    params = SamplingParams(temperature=0, max_tokens=args.check_tokens, ignore_eos=True)
    prompts = [[100 + (7 * i + j) % 400 for j in range(n)] for i, n in enumerate((5, 33, 130, 511))]
    with LLM(args.model, load_format="dummy", dtype="float32", tp=tp, device=devices(tp, cuda),
             num_kv_blocks=args.num_kv_blocks or 1024, max_num_seqs=8) as llm:  # fmt: skip
        out = [o.token_ids for o in llm.generate(prompts, params)]
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def check_equality(args) -> dict:
    one, many = greedy_tokens(args, 1), greedy_tokens(args, args.tp)
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
                  for x, y in zip(one, many, strict=True)]  # fmt: skip
    result = {"tp": args.tp, "equal": one == many, "first_difference": first_diff}
    print("greedy TP1 vs TP", args.tp, result, flush=True)
    return result


def check_in_child(args) -> dict:
    """`check_equality` in a child process: a process joins one NCCL group only (groups whose
    collectives were captured in graphs are not destroyed: `TPGroup.close`), and the decode
    benchmark's worker needs its own."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_check_into, args=(args, results))
    child.start()
    try:
        result = results.get(timeout=900)  # a child that died raises queue.Empty here
    finally:
        child.join(timeout=60)
    return result


def _check_into(args, results) -> None:
    results.put(check_equality(args))


def print_table(rows: list[dict], check: dict | None) -> None:
    print(f"\n{'tp':>3} {'batch':>6} {'step ms':>8} {'hbm ms':>7} {'comm ms':>8} {'ratio':>6}")
    for r in rows:
        f = r.get("floor_s")
        print(f"{r['tp']:>3} {r['batch']:>6} {r['step_s'] * 1e3:8.2f} "
              f"{(r.get('hbm_floor_s') or 0) * 1e3:7.2f} {(r.get('comm_floor_s') or 0) * 1e3:8.2f} "
              f"{r['step_s'] / f if f else float('nan'):6.2f}")  # fmt: skip
    print("target: ratio <= 1.3")
    if check is not None:
        print(f"greedy TP1 == TP{check['tp']} (fp32): {check['equal']}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(CONFIG), help="config dir (dummy weights)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of each request")
    ap.add_argument("--min-new", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--check-tokens", type=int, default=32, help="greedy tokens compared")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--kernel-profile", action="store_true", help="rank 0's device time per kernel")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny sizes")
    ap.add_argument("--out", default="benchmarks/results/tp")
    args = ap.parse_args()
    if args.smoke:
        folder = Path(tempfile.mkdtemp(prefix="bench_tp_"))
        (folder / "config.json").write_text(json.dumps(TINY))
        args.model, args.dtype, args.batches, args.context = str(folder), "float32", [2, 4], 20
        args.min_new, args.max_new, args.steps, args.warmup = 4, 8, 5, 2
        args.num_kv_blocks, args.check_tokens, args.max_num_batched_tokens = 64, 6, 256
    return args


def main() -> None:
    args = parse_args()
    started = time.time()
    ceil = None if args.smoke else measure_ceilings()
    peer = None if args.smoke else peer_bandwidth()
    print("ceilings:", ceil, "peer copy bytes/s:", peer, flush=True)
    check = None if args.no_check else check_in_child(args)
    rows = bench_decode(args, ceil, peer)
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"ceilings": ceil, "peer_bytes_per_s": peer, "decode": rows,
                               "equality": check, "seconds": time.time() - started}, indent=1))  # fmt: skip
    print_table(rows, check)


if __name__ == "__main__":
    main()
