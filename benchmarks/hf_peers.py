"""HF transformers peers of the offline-throughput benchmark (same GPU, same workload):
`generate_batch` (continuous batching) and padded `generate()`."""

from __future__ import annotations

import time
from pathlib import Path

import torch


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


def run(args, config_dir: Path, reqs) -> dict:
    """The peers named in `args.peers` on `reqs`; keys name the peer and the request count."""
    out = {}
    model = hf_model(config_dir)
    if "hf_cb" in args.peers:
        out[f"hf_generate_batch_{len(reqs)}"] = bench_hf_cb(model, reqs)
    if "hf_generate" in args.peers:
        model.set_attn_implementation("sdpa")
        out[f"hf_generate_{len(reqs)}"] = bench_hf_generate(model, reqs, args.hf_batch_size)
    del model
    torch.cuda.empty_cache()
    return out
