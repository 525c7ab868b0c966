"""MLA prefill, absorbed against decompressed: one DeepSeek-V2-Lite layer's attention and the
whole model's prefill step, with the FLOPs of each form and the bf16 matmul rate of the run.

    python benchmarks/bench_mla_prefill.py [--out mla_prefill.json] [--prompts 512 2048 8192]
        [--prefixes 0 4096] [--parts layer engine] [--reps 10] [--enforce-eager]
    python benchmarks/bench_mla_prefill.py --smoke [--out x.json]   # CPU, tiny, interpreter

Layer: one sequence of P new tokens after C cached ones (bf16; 16 heads, Dc 512, Dr 64,
Dn = Dv = 128; 64-token pages in shuffled order) through `TritonAttentionBackend.latent_prefill`
in each form, the absorption and expansion matmuls included. Time: median of --reps calls,
each timed with CUDA events (`roofline.time_fn`). `max_err` = max |absorbed - decompressed|,
`rel_err` the same over max |absorbed| (beyond --tol the run exits 1). FLOPs per head, with
pairs = P * C + P (P + 1) / 2 (query, visible key):
- absorbed: pairs * (2 (Dc + Dr) + 2 Dc) + P * 2 Dc (Dn + Dv) (W_UK into q, W_UV after);
- decompressed: pairs * (2 (Dn + Dr) + 2 Dv) + (C + P) * 2 Dc (Dn + Dv) (K and V rebuilt).
`*_matmul_frac` = FLOPs / time / the bf16 matmul rate (`roofline.measure_ceilings`, this run).
The decompressed form's parts: `rebuild_ms` (`mla_prefill.rebuild_kv` of the gathered rows)
and its attention alone with V padded to Dn + Dr (`attn_padded_ms`, what a GPU runs:
`mla_prefill.PAD_VALUES_ON_CUDA`) and unpadded (`attn_unpadded_ms`).

Engine (`--parts engine`): DeepSeek-V2-Lite's config with dummy weights, loaded once; a prefill
step of P tokens after C cached ones (the prefix written by a step before), `ModelRunner.execute`
timed as above, the backend's `mla_prefill` switched between forms. FLOPs: the decoder's
matmuls for P tokens, the LM head for one, and each form's attention over every layer.
--smoke: a tiny DeepSeek-V2 (`moe_configs.TINY`) on the CPU's torch backend. Prints the JSON,
then a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

V2_LITE = ROOT / "configs" / "deepseek-v2-lite"
PAGE = 64
FORMS = ("absorbed", "decompressed")


@dataclasses.dataclass(frozen=True)
class Widths:
    heads: int
    dc: int  # kv_lora_rank
    dr: int  # qk_rope_head_dim
    dn: int  # qk_nope_head_dim
    dv: int  # v_head_dim


V2_LITE_LAYER = Widths(heads=16, dc=512, dr=64, dn=128, dv=128)
SMOKE_LAYER = Widths(heads=4, dc=512, dr=64, dn=32, dv=32)


def form_flops(w: Widths, prompt: int, prefix: int) -> dict[str, float]:
    """One layer's FLOPs of each form (module docstring), all heads."""
    pairs = prompt * prefix + prompt * (prompt + 1) / 2
    projection = 2 * w.dc * (w.dn + w.dv)  # one token through W_UK and W_UV, per head
    return {
        "absorbed": w.heads * (pairs * (4 * w.dc + 2 * w.dr) + prompt * projection),
        "decompressed": w.heads
        * (pairs * (2 * (w.dn + w.dr) + 2 * w.dv) + (prefix + prompt) * projection),
    }


def layer_case(w: Widths, prompt: int, prefix: int, device: torch.device):
    """(q_nope, q_pe, proj, cache, metadata, scale) of one sequence in shuffled pages."""
    from common.model.attention.base import AttentionMetadata, LatentProjection

    gen = torch.Generator(device=device).manual_seed(prompt + prefix)
    dtype, total = torch.bfloat16, prefix + prompt
    pages = -(-total // PAGE)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    cache = rnd(pages + 1, PAGE, 1, w.dc + w.dr)
    table = torch.randperm(pages, generator=gen, device=device).to(torch.int32)[None]
    positions = torch.arange(prefix, total, device=device)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, prompt], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([total], dtype=torch.int32, device=device),
        block_tables=table,
        slot_mapping=table[0, positions // PAGE].long() * PAGE + positions % PAGE,
        query_lens_cpu=[prompt],
        seq_lens_cpu=[total],
        max_query_len=prompt,
        max_seq_len=total,
    )
    proj = LatentProjection(rnd(w.heads, w.dn, w.dc, scale=w.dc**-0.5),
                            rnd(w.heads, w.dv, w.dc, scale=w.dc**-0.5))  # fmt: skip
    q_nope, q_pe = rnd(prompt, w.heads, w.dn), rnd(prompt, w.heads, w.dr)
    return q_nope, q_pe, proj, cache, metadata, (w.dn + w.dr) ** -0.5


def bench_layer(w: Widths, prompt: int, prefix: int, args, rate: float | None) -> dict:
    from benchmarks.roofline import time_fn
    from common.model.attention import create_backend
    from common.model.attention.mla_prefill import (
        context_rows,
        dense_causal_attention,
        rebuild_kv,
    )

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    q_nope, q_pe, proj, cache, md, scale = layer_case(w, prompt, prefix, device)
    row: dict = {"prompt": prompt, "prefix": prefix, "heads": w.heads}
    outs = {}
    flops = form_flops(w, prompt, prefix)
    for form in FORMS:
        backend = create_backend("triton", form)

        def call(backend=backend) -> torch.Tensor:
            return backend.latent_prefill(q_nope, q_pe, proj, cache, md, scale)

        outs[form] = call().float()
        seconds = time_fn(call, args.reps, cuda)
        row[f"{form}_ms"] = round(seconds * 1e3, 3)
        row[f"{form}_flops"] = flops[form]
        row[f"{form}_matmul_frac"] = rate and round(flops[form] / seconds / rate, 3)
    row["speedup"] = round(row["absorbed_ms"] / row["decompressed_ms"], 3)
    err = (outs["absorbed"] - outs["decompressed"]).abs().max().item()
    row["max_err"], row["rel_err"] = err, err / outs["absorbed"].abs().max().item()
    rows = context_rows(cache, md.block_tables[0], prefix + prompt)
    row["rebuild_ms"] = round(time_fn(lambda: rebuild_kv(rows, proj, rows.dtype), args.reps,
                                      cuda) * 1e3, 3)  # fmt: skip
    keys, values = rebuild_kv(rows, proj, rows.dtype)
    query = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)
    for name, pad in (("attn_padded_ms", True), ("attn_unpadded_ms", False)):
        seconds = time_fn(lambda pad=pad: dense_causal_attention(query, keys, values, scale, pad),
                          args.reps, cuda)  # fmt: skip
        row[name] = round(seconds * 1e3, 3)
    print("layer:", row, flush=True)
    return row


def engine_flops(model, spec, prompt: int, prefix: int) -> dict[str, float]:
    """A prefill step's FLOPs in each form: the decoder's matmuls for `prompt` rows, the LM head
    for one, each form's attention in every layer."""
    from benchmarks.roofline import matmul_params

    high, fp8 = matmul_params(model)
    mla = spec.mla
    w = Widths(spec.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim,
               mla.v_head_dim)  # fmt: skip
    # kv_b_proj is in matmul_params, but no form multiplies the new tokens by it as a linear
    # layer: each form's use of it (W_UK / W_UV, or the rebuild) is in form_flops.
    kv_b = spec.num_layers * mla.kv_lora_rank * spec.num_heads * (w.dn + w.dv)
    dense = 2 * prompt * (high + fp8 - kv_b) + 2 * spec.vocab_size * spec.hidden_size
    layer = form_flops(w, prompt, prefix)
    return {form: dense + spec.num_layers * layer[form] for form in FORMS}


def bench_engine(args, rate: float | None) -> list[dict]:
    from benchmarks.roofline import time_fn
    from common import LLM, SamplingParams
    from common.engine.scheduler import ScheduledBatch, ScheduledSeq
    from common.engine.sequence import Sequence

    options = dict(model=args.model, load_format="dummy", dtype=args.dtype, device=args.device,
                   enable_prefix_caching=False, enforce_eager=args.enforce_eager,
                   max_num_batched_tokens=max(args.prompts + args.prefixes),
                   mla_prefill="absorbed")  # fmt: skip
    llm = LLM(**options)
    worker = llm.engine.worker
    spec, cuda, bs = worker.rank_spec, worker.device.type == "cuda", worker.runtime.block_size
    rows = []
    for prefix in args.prefixes:
        for prompt in args.prompts:
            total = prefix + prompt
            gen = torch.Generator().manual_seed(total)
            ids = torch.randint(0, spec.vocab_size, (total,), generator=gen).tolist()
            seq = Sequence(f"p{prompt}c{prefix}", ids, SamplingParams(temperature=0))
            seq.block_ids = worker.allocator.allocate(-(-(total + 1) // bs))
            if prefix:
                worker.runner.execute(ScheduledBatch([ScheduledSeq(seq, 0, prefix)]))
            step = ScheduledBatch([ScheduledSeq(seq, prefix, prompt)])
            row: dict = {"prompt": prompt, "prefix": prefix}
            flops, tokens = engine_flops(worker.model, spec, prompt, prefix), {}
            for form in FORMS:
                worker.backend.mla_prefill = form  # same weights and pool, the other form
                tokens[form] = worker.runner.execute(step)[0].token_id
                seconds = time_fn(functools.partial(worker.runner.execute, step), args.reps, cuda)
                row[f"{form}_ms"] = round(seconds * 1e3, 3)
                row[f"{form}_flops"] = flops[form]
                row[f"{form}_matmul_frac"] = rate and round(flops[form] / seconds / rate, 3)
            row["speedup"] = round(row["absorbed_ms"] / row["decompressed_ms"], 3)
            row["same_first_token"] = tokens["absorbed"] == tokens["decompressed"]
            worker.allocator.free(seq.block_ids)
            rows.append(row)
            print("engine:", row, flush=True)
    llm.close()
    return rows


def print_table(report: dict) -> None:
    print(f"{'part':>6} {'prompt':>6} {'prefix':>6} | {'absorbed ms':>11} {'frac':>5} | "
          f"{'decomp. ms':>10} {'frac':>5} | {'speedup':>7}")  # fmt: skip
    for part in ("layer", "engine"):
        for r in report.get(part, []):
            fa, fd = r["absorbed_matmul_frac"], r["decompressed_matmul_frac"]
            print(f"{part:>6} {r['prompt']:>6} {r['prefix']:>6} | {r['absorbed_ms']:>11.3f} "
                  f"{fa if fa is not None else '-':>5} | {r['decompressed_ms']:>10.3f} "
                  f"{fd if fd is not None else '-':>5} | {r['speedup']:>7.2f}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[0, 4096])
    ap.add_argument("--parts", nargs="+", default=["layer", "engine"], choices=["layer", "engine"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tol", type=float, default=3e-2, help="max rel_err of the layer rows")
    ap.add_argument("--enforce-eager", action="store_true", help="engine: no CUDA graphs")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET, tiny shapes")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.smoke and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and not args.smoke:
        ap.error("no GPU: run with --smoke")
    widths, args.model, args.dtype = V2_LITE_LAYER, str(V2_LITE), "bfloat16"
    if args.smoke:
        from benchmarks.moe_configs import write_tiny

        args.prompts, args.prefixes, args.reps = [16, 40], [0, 24], 1
        widths, args.dtype = SMOKE_LAYER, "float32"
        out_dir = (args.out.parent if args.out else Path("/tmp")) / "mla_prefill_tiny"
        args.model = str(write_tiny("deepseek-v2", out_dir))
    from benchmarks.roofline import measure_ceilings

    ceilings = measure_ceilings()
    rate = ceilings and ceilings["bf16_flops_per_s"]
    report: dict = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "ceilings": ceilings,
        "layer_widths": dataclasses.asdict(widths),
        "timing": "median of --reps calls, each timed with CUDA events (CPU: the host clock)",
    }
    started = time.perf_counter()
    if "layer" in args.parts:
        report["layer"] = [
            bench_layer(widths, p, c, args, rate) for c in args.prefixes for p in args.prompts
        ]
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if "engine" in args.parts:
        report["engine"] = bench_engine(args, rate)
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)
    bad = [r for r in report.get("layer", []) if not r["rel_err"] <= args.tol]
    for r in bad:
        print(f"FAIL prompt={r['prompt']} prefix={r['prefix']}: rel_err {r['rel_err']:.3g} > "
              f"{args.tol}", file=sys.stderr)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
