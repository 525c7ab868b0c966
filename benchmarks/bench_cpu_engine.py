"""Offline decode throughput of the engine vs HF transformers `generate()`, same process, same
weights (the embedded SmolLM2-135M-Instruct unless --model), greedy, fixed lengths.

    python benchmarks/bench_cpu_engine.py --batch-sizes 1 16 --prompt-len 64 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from common import LLM, SamplingParams


def time_ours(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return elapsed


@torch.inference_mode()
def time_hf(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + new_tokens
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    llm = LLM(args.model, device="cpu", enable_prefix_caching=False)
    hf = AutoModelForCausalLM.from_pretrained(
        llm.engine.worker.source.directory, dtype=torch.float32
    ).eval()
    g = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batch_sizes:
        prompts = torch.randint(100, 40000, (batch, args.prompt_len), generator=g).tolist()
        time_ours(llm, prompts, 4)  # warm-up
        time_hf(hf, prompts, 4)
        ours = statistics.median(
            time_ours(llm, prompts, args.new_tokens) for _ in range(args.repeats)
        )
        theirs = statistics.median(
            time_hf(hf, prompts, args.new_tokens) for _ in range(args.repeats)
        )
        tokens = batch * args.new_tokens
        rows.append(
            {
                "batch": batch,
                "ours_tok_s": tokens / ours,
                "hf_generate_tok_s": tokens / theirs,
                "ratio": theirs / ours,
            }
        )
    print(
        json.dumps(
            {
                "threads": torch.get_num_threads(),
                "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens,
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"{'batch':>5} {'ours tok/s':>11} {'HF generate tok/s':>18} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['ours_tok_s']:>11.1f} {r['hf_generate_tok_s']:>18.1f} {r['ratio']:>6.2f}"
        )


if __name__ == "__main__":
    main()
