"""Perplexity of the embedded model (SmolLM2-135M-Instruct) on a fixed English text, per
precision: fp32, bf16, FP8 W8A8 (`--quantization fp8`), FP8 KV cache (`--kv-cache-dtype fp8`,
the default scales of 1.0: the checkpoint has none) and both. Each window is one prefill
through the model's forward and the torch attention backend over a paged KV cache in
`kv_dtype`, so attention reads K and V back from the cache as the engine does, and every next
token is scored; windows are consecutive and non-overlapping.

    python benchmarks/perplexity.py [--windows 4] [--window 512] [--out perplexity.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common.engine.kv_cache import KVCache, kv_cache_dtype
from common.model.attention.base import AttentionMetadata, ForwardContext
from common.model.attention.torch_backend import TorchAttentionBackend
from common.model.loader import build_model
from common.model.source import read_spec, resolve_model
from common.text.tokenizer import load_tokenizer

TEXT = Path("/usr/share/common-licenses/GPL-3")
BLOCK = 16


@dataclass(frozen=True)
class Variant:
    name: str
    dtype: str  # model dtype
    quantization: str = "auto"
    kv_dtype: str = "auto"  # --kv-cache-dtype: "auto" (the model dtype) or "fp8"


VARIANTS = [
    Variant("fp32", "float32"),
    Variant("bf16", "bfloat16"),
    Variant("FP8 W8A8", "bfloat16", quantization="fp8"),
    Variant("FP8 KV", "bfloat16", kv_dtype="fp8"),
    Variant("W8A8 + FP8 KV", "bfloat16", quantization="fp8", kv_dtype="fp8"),
]


def windows(count: int, size: int) -> list[torch.Tensor]:
    tokenizer = load_tokenizer(resolve_model(None).directory)
    ids = tokenizer.encode(TEXT.read_text())
    if len(ids) < count * size:
        raise ValueError(f"{TEXT} has {len(ids)} tokens, fewer than {count} x {size}")
    return [torch.tensor(ids[i * size : (i + 1) * size]) for i in range(count)]


def metadata(n: int) -> AttentionMetadata:
    """One sequence of `n` new tokens in blocks 0, 1, ... of the cache."""
    blocks = -(-n // BLOCK)
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(n, dtype=torch.int64),
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
        max_query_len=n,
        max_seq_len=n,
    )


@torch.inference_mode()
def run_window(model, kv: KVCache, ids: torch.Tensor) -> tuple[float, int]:
    """Summed negative log-likelihood of tokens 1.. given their prefixes, and their count."""
    spec = model.spec
    ctx = ForwardContext(
        TorchAttentionBackend(), metadata(len(ids)), kv.k_caches, kv.v_caches,
        spec.attention_scale, **kv.context_kwargs(),
    )  # fmt: skip
    hidden = model(ids, torch.arange(len(ids)), ctx)
    logprobs = model.compute_logits(hidden[:-1]).log_softmax(-1)
    return -logprobs.gather(1, ids[1:, None]).sum().item(), len(ids) - 1


def perplexity(variant: Variant, texts: list[torch.Tensor]) -> dict:
    source = resolve_model(None, variant.dtype)
    spec, dtype = read_spec(source), getattr(torch, variant.dtype)
    size = max(len(t) for t in texts)
    model = build_model(
        spec, source, max_positions=size, dtype=dtype, device=torch.device("cpu"),
        quantization=variant.quantization,
    )  # fmt: skip
    kv = KVCache.allocate(
        model.spec, -(-size // BLOCK), BLOCK, kv_cache_dtype(variant.kv_dtype, dtype),
        torch.device("cpu"),
    )  # fmt: skip
    start, nll, count = time.monotonic(), 0.0, 0
    for ids in texts:
        window_nll, n = run_window(model, kv, ids)
        nll, count = nll + window_nll, count + n
    return {**asdict(variant), "perplexity": math.exp(nll / count), "tokens": count,
            "seconds": round(time.monotonic() - start, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("perplexity.json"))
    args = parser.parse_args()
    texts = windows(args.windows, args.window)
    rows = [perplexity(v, texts) for v in VARIANTS]
    base = rows[0]["perplexity"]
    print(f"{TEXT}: {args.windows} windows x {args.window} tokens")
    print(f"{'variant':<16}{'perplexity':>12}{'vs fp32':>10}{'seconds':>9}")
    for row in rows:
        change = 100 * (row["perplexity"] / base - 1)
        print(f"{row['name']:<16}{row['perplexity']:>12.4f}{change:>+9.2f}%{row['seconds']:>9}")
    result = {"text": str(TEXT), "windows": args.windows, "window": args.window, "rows": rows}
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
