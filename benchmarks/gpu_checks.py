"""GPU correctness checks that need real-model shapes: bf16 logits of Qwen2.5-7B-shaped dummy
weights through our engine against HF transformers holding the very same weights.

    python benchmarks/gpu_checks.py [--model benchmarks/configs/qwen2.5-7b-instruct] [--tokens 512]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from common import LLM
from common.engine.scheduler import ScheduledBatch, ScheduledSeq
from common.engine.sequence import Sequence
from common.protocol.sampling_params import SamplingParams


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """Our fused parameters split back into HF's q/k/v and gate/up tensors (one rank: every
    shard is whole)."""
    out = {}
    for name, param in model.named_parameters():
        module, kind = name.rsplit(".", 1)
        parts = model.packed_modules.get(module.rsplit(".", 1)[-1])
        if parts is None:
            out[name] = param
            continue
        sizes = model.get_submodule(module).output_sizes
        parent = module.rsplit(".", 1)[0]
        for part, tensor in zip(parts, param.split(sizes), strict=True):
            out[f"{parent}.{part}.{kind}"] = tensor
    if model.spec.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--model", default=str(Path(__file__).parent / "configs" / "qwen2.5-7b-instruct")
    )
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--attention-backend", default="auto")
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    llm = LLM(
        args.model,
        load_format="dummy",
        dtype="bfloat16",
        attention_backend=args.attention_backend,
        kv_cache_memory_bytes=4 << 30,
        max_num_seqs=8,
        enforce_eager=True,
    )
    worker = llm.engine.worker
    config = AutoConfig.from_pretrained(args.model)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    missing, unexpected = hf.load_state_dict(hf_state_dict(worker.model), strict=False)
    assert not unexpected and all("rotary" in m or m == "lm_head.weight" for m in missing), (
        missing,
        unexpected,
    )
    hf.eval()

    prompt = torch.randint(
        0, worker.spec.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    seq = Sequence("check", prompt, SamplingParams(temperature=0))
    seq.block_ids = worker.allocator.allocate(
        -(-(len(prompt) + 1) // worker.config.cache.block_size)
    )
    ctx_batch = ScheduledBatch([ScheduledSeq(seq, 0, len(prompt))])
    h = worker.runner.host_inputs(ctx_batch)
    from common.model.attention import ForwardContext

    md = worker.runner.metadata(h)
    ctx = ForwardContext(
        worker.backend, md, worker.kv_cache.k_caches, worker.kv_cache.v_caches, worker.runner.scale
    )
    ids = torch.tensor(prompt, device="cuda")
    ours = worker.model.compute_logits(
        worker.model(ids, torch.arange(len(prompt), device="cuda"), ctx)
    )
    theirs = hf(ids[None]).logits[0].float()
    diff = (ours - theirs).abs()
    report = {
        "model": Path(args.model).name,
        "backend": worker.backend.name,
        "tokens": len(prompt),
        "max_abs_diff": diff.max().item(),
        "mean_abs_diff": diff.mean().item(),
        "max_abs_logit": theirs.abs().max().item(),
        "argmax_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
