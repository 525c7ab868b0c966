"""GPU engine benchmark: decode step vs HBM floor, prefill vs FLOP floor, offline throughput vs
HF transformers, CUDA graphs on/off. One GPU, dummy weights of a real architecture (default
Qwen2.5-7B in bf16). Ceilings (copy bandwidth, bf16 matmul rate) are measured in the same run.

    python benchmarks/bench_engine.py --out results/engine              # everything, ours only
    python benchmarks/bench_engine.py --parts throughput --peers hf_cb hf_generate --requests 64

Prints a table last; writes <out>.json and <out>.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path

import torch

from common import LLM, SamplingParams
from common.scheduler import ScheduledBatch, ScheduledSeq
from common.sequence import Sequence

ROOT = Path(__file__).resolve().parent
CONFIG = ROOT / "configs" / "qwen2.5-7b-instruct"


def cuda_time(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of `fn()` over `repeats` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure_ceilings() -> dict[str, float]:
    n = 1 << 30  # 2 GiB of bf16 per buffer
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_s = cuda_time(lambda: dst.copy_(src), 20)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_s = cuda_time(lambda: a @ b, 20)
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * n * 2 / copy_s, "bf16_flops_per_s": 2 * 8192**3 / mm_s}


def fake_sequences(llm: LLM, batch: int, context: int, tag: str) -> ScheduledBatch:
    """`batch` sequences whose first context-1 tokens are 'already in the cache' (random KV)."""
    worker = llm.engine.worker
    out = ScheduledBatch()
    for i in range(batch):
        seq = Sequence(
            f"{tag}-{i}", [7] * (context - 1), SamplingParams(temperature=0, max_tokens=4)
        )
        seq.output_token_ids.append(11)
        seq.block_ids = worker.allocator.allocate(-(-context // worker.config.cache.block_size))
        assert seq.block_ids is not None, "KV pool too small for the benchmark batch"
        seq.num_computed_tokens = context - 1
        out.items.append(ScheduledSeq(seq, context - 1, 1))
    return out


def free(llm: LLM, batch: ScheduledBatch) -> None:
    for item in batch.items:
        llm.engine.worker.allocator.free(item.seq.block_ids)


def bench_decode(
    llm: LLM, ceil: dict, batches: list[int], context: int, repeats: int
) -> list[dict]:
    worker, spec = llm.engine.worker, llm.engine.worker.spec
    weight_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    embed = worker.model.model.embed_tokens.weight
    weight_bytes -= embed.numel() * embed.element_size()  # a lookup reads rows, not the table
    kv_token = spec.kv_bytes_per_token(worker.kv_cache.pool.element_size())
    worker.kv_cache.pool.normal_()  # never time attention over zeros
    rows = []
    for b in batches:
        batch = fake_sequences(llm, b, context, f"dec{b}")
        step = cuda_time(lambda batch=batch: worker.runner.execute(batch), repeats)
        replay = None
        graphs = worker.runner.graphs
        if graphs is not None and graphs.fits(b):
            size = next(s for s in graphs.sizes if s >= b)
            replay = cuda_time(graphs.graphs[size].replay, repeats)  # GPU time of the model step
        floor = (weight_bytes + b * context * kv_token) / ceil["copy_bytes_per_s"]
        eager = None
        if worker.runner.graphs is not None:
            graphs, worker.runner.graphs = worker.runner.graphs, None
            eager = cuda_time(lambda batch=batch: worker.runner.execute(batch), repeats)
            worker.runner.graphs = graphs
        free(llm, batch)
        rows.append(
            {
                "batch": b,
                "context": context,
                "step_s": step,
                "graph_replay_s": replay,
                "eager_step_s": eager,
                "hbm_floor_s": floor,
                "ratio_to_floor": step / floor,
            }
        )
    return rows


def bench_prefill(llm: LLM, ceil: dict, lengths: list[int], repeats: int) -> list[dict]:
    worker, spec = llm.engine.worker, llm.engine.worker.spec
    params = sum(p.numel() for n, p in worker.model.named_parameters() if "embed_tokens" not in n)
    rows = []
    for n in lengths:
        seq = Sequence(
            f"pre{n}",
            torch.randint(0, spec.vocab_size, (n,)).tolist(),
            SamplingParams(temperature=0),
        )
        seq.block_ids = worker.allocator.allocate(-(-(n + 1) // worker.config.cache.block_size))
        batch = ScheduledBatch([ScheduledSeq(seq, 0, n)])
        t = cuda_time(lambda batch=batch: worker.runner.execute(batch), repeats)
        worker.allocator.free(seq.block_ids)
        # Matmuls over every token (the LM head only for the last) plus causal attention.
        flops = (
            2 * n * (params - spec.vocab_size * spec.hidden_size)
            + 2 * spec.vocab_size * spec.hidden_size
        )
        flops += 2 * n * n * spec.head_dim * spec.num_heads * spec.num_layers
        floor = flops / ceil["bf16_flops_per_s"]
        rows.append(
            {"tokens": n, "time_s": t, "flop_floor_s": floor, "fraction_of_matmul_rate": floor / t}
        )
    return rows


def workload(num: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(100, vocab - 100) for _ in range(rng.randint(100, 1024))],
            rng.randint(100, 1024),
        )
        for _ in range(num)
    ]


def bench_ours_throughput(llm: LLM, reqs) -> dict:
    prompts = [p for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    llm.generate(prompts[:4], params[:4])  # warm-up (Triton autotune, allocator)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(n for _, n in reqs)
    return {
        "requests": len(reqs),
        "output_tokens": tokens,
        "time_s": elapsed,
        "tokens_per_s": tokens / elapsed,
    }


def hf_model(config_dir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    model.generation_config.eos_token_id = None
    return model.eval()


def bench_hf_cb(model, reqs) -> dict:
    from transformers import GenerationConfig

    gen = GenerationConfig(
        max_new_tokens=max(n for _, n in reqs), do_sample=False, eos_token_id=None
    )
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    start = time.perf_counter()
    for i, (p, n) in enumerate(reqs):
        manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
    tokens, done = 0, 0
    while done < len(reqs):
        result = manager.get_result(timeout=600)
        if result is None:
            break
        if result.is_finished():
            done += 1
            tokens += len(result.generated_tokens)
    elapsed = time.perf_counter() - start
    manager.stop(block=True)
    return {
        "requests": done,
        "output_tokens": tokens,
        "time_s": elapsed,
        "tokens_per_s": tokens / elapsed,
        "attn_implementation": str(model.config._attn_implementation),
    }


@torch.inference_mode()
def bench_hf_generate(model, reqs, batch_size: int) -> dict:
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long, device="cuda")
        mask = torch.zeros_like(ids)
        for r, (p, _) in enumerate(chunk):  # left padding
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        new = max(n for _, n in chunk)
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
        tokens += sum(n for _, n in chunk)  # count only the tokens each request asked for
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {
        "requests": len(reqs),
        "output_tokens": tokens,
        "time_s": elapsed,
        "tokens_per_s": tokens / elapsed,
        "batch_size": batch_size,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    if result.get("decode"):
        d = result["decode"]
        x = range(len(d))
        axes[0].bar(
            [i - 0.2 for i in x], [r["step_s"] * 1e3 for r in d], 0.4, label="ours (graphs)"
        )
        axes[0].bar(
            [i + 0.2 for i in x], [r["hbm_floor_s"] * 1e3 for r in d], 0.4, label="HBM floor"
        )
        axes[0].set_xticks(list(x), [f"batch {r['batch']}" for r in d])
        axes[0].set_ylabel("ms per decode step (1k context)")
        axes[0].legend()
    if result.get("prefill"):
        p = result["prefill"]
        axes[1].bar([str(r["tokens"]) for r in p], [100 * r["fraction_of_matmul_rate"] for r in p])
        axes[1].axhline(55, color="red", linestyle="--", label="target 55%")
        axes[1].set_ylabel("% of measured bf16 matmul rate")
        axes[1].set_xlabel("prompt tokens")
        axes[1].legend()
    if result.get("throughput"):
        t = result["throughput"]
        axes[2].bar(list(t), [v["tokens_per_s"] for v in t.values()])
        axes[2].set_ylabel("output tokens/s")
    fig.suptitle(f"{result['model']} on {result['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default=str(CONFIG), help="a directory with config.json (dummy weights)"
    )
    ap.add_argument(
        "--parts",
        nargs="+",
        default=["decode", "prefill", "throughput"],
        choices=["decode", "prefill", "throughput"],
    )
    ap.add_argument("--peers", nargs="*", default=[], choices=["hf_cb", "hf_generate"])
    ap.add_argument("--requests", type=int, default=256, help="offline workload size for ours")
    ap.add_argument(
        "--peer-requests",
        type=int,
        default=64,
        help="subset (first N) run by the HF peers and by ours again",
    )
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--decode-contexts", type=int, nargs="+", default=[1024])
    ap.add_argument("--out", default="benchmarks/results/engine")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ceil = measure_ceilings()
    torch.cuda.empty_cache()
    result: dict = {
        "gpu": torch.cuda.get_device_name(),
        "model": Path(args.model).name,
        "ceilings": ceil,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        load_format="dummy",
        dtype="bfloat16",
        attention_backend=args.attention_backend,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
    )
    rt = llm.engine.runtime
    result["engine"] = {
        "load_and_capture_s": time.perf_counter() - t0,
        "backend": rt.attention_backend,
        "num_kv_blocks": rt.num_kv_blocks,
        "cuda_graph_bytes": rt.cuda_graph_bytes,
    }
    print("engine:", result["engine"], flush=True)
    if "decode" in args.parts:
        result["decode"] = [
            row
            for context in args.decode_contexts
            for row in bench_decode(llm, ceil, args.decode_batches, context, args.repeats)
        ]
        print("decode:", result["decode"], flush=True)
    if "prefill" in args.parts:
        result["prefill"] = bench_prefill(llm, ceil, [512, 2048, 8192], max(5, args.repeats // 4))
        print("prefill:", result["prefill"], flush=True)
    throughput = {}
    if "throughput" in args.parts:
        reqs = workload(args.requests, 0, rt.vocab_size)
        throughput[f"ours_{args.requests}"] = bench_ours_throughput(llm, reqs)
        if args.peers:
            throughput[f"ours_{args.peer_requests}"] = bench_ours_throughput(
                llm, reqs[: args.peer_requests]
            )
        print("throughput:", throughput, flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    if args.peers:
        reqs = workload(args.requests, 0, rt.vocab_size)[: args.peer_requests]
        model = hf_model(Path(args.model))
        if "hf_cb" in args.peers:
            throughput[f"hf_generate_batch_{args.peer_requests}"] = bench_hf_cb(model, reqs)
            print("hf_cb:", throughput[f"hf_generate_batch_{args.peer_requests}"], flush=True)
        if "hf_generate" in args.peers:
            model.set_attn_implementation("sdpa")
            throughput[f"hf_generate_{args.peer_requests}"] = bench_hf_generate(
                model, reqs, args.hf_batch_size
            )
            print("hf_generate:", throughput[f"hf_generate_{args.peer_requests}"], flush=True)
    result["throughput"] = throughput
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(
        f"\nceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s"
    )
    for r in result.get("decode", []):
        eager = f"{r['eager_step_s'] * 1e3:.2f}" if r["eager_step_s"] else "-"
        replay = f"{r['graph_replay_s'] * 1e3:.2f}" if r["graph_replay_s"] else "-"
        print(
            f"decode b={r['batch']:<4} step {r['step_s'] * 1e3:7.2f} ms  replay {replay} ms  eager {eager} ms  floor {r['hbm_floor_s'] * 1e3:6.2f} ms  x{r['ratio_to_floor']:.2f}"
        )
    for r in result.get("prefill", []):
        print(
            f"prefill {r['tokens']:>5} tok  {r['time_s'] * 1e3:8.1f} ms  floor {r['flop_floor_s'] * 1e3:7.1f} ms  {100 * r['fraction_of_matmul_rate']:.0f}% of matmul rate"
        )
    for name, r in throughput.items():
        print(
            f"throughput {name:<26} {r['tokens_per_s']:9.0f} tok/s  ({r['output_tokens']} tokens in {r['time_s']:.1f} s)"
        )


if __name__ == "__main__":
    main()
