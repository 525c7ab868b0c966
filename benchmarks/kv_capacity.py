"""How many sequences of a given context fit in one device's KV pool, per model: arithmetic from
each config.json (no weights loaded, no GPU), for comparing cache layouts such as
DeepSeek-V2-Lite's MLA latent against Qwen2.5-7B's grouped K/V heads.

    python benchmarks/kv_capacity.py benchmarks/configs/deepseek-v2-lite \\
        benchmarks/configs/qwen2.5-7b-instruct --contexts 1024 8192 --memory-gib 139

Per model: the cache geometry, `ModelSpec.kv_bytes_per_token` at --kv-dtype-bytes, the
weights' bytes (the meta-device model's parameters in bf16: shapes only), the KV
budget = memory * --fraction - weights (the worker sizes its pool so at kv_memory_fraction;
activations and CUDA graphs, a few hundred MB, are left out), and per context the sequences
that fit whole: budget // (context rounded up to whole blocks * KV bytes per token). A model
this checkout cannot parse is reported with its error. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.model.loader import build_model  # noqa: E402
from common.model.source import read_spec, resolve_model  # noqa: E402
from common.model.spec import ModelSpec  # noqa: E402

GIB = 1 << 30


def kv_capacity(
    spec: ModelSpec,
    weight_bytes: int,
    memory_bytes: int,
    contexts: list[int],
    kv_dtype_bytes: int = 2,
    block_size: int = 16,
) -> dict:
    """Sequences of each context whose KV fits beside the weights in `memory_bytes`."""
    if weight_bytes >= memory_bytes:
        raise ValueError(f"weights of {weight_bytes} bytes leave no KV in {memory_bytes} bytes")
    per_token = spec.kv_bytes_per_token(kv_dtype_bytes)
    budget = memory_bytes - weight_bytes
    sequences = {}
    for context in contexts:
        if context < 1:
            raise ValueError(f"a context of {context} tokens")
        tokens = -(-context // block_size) * block_size  # a sequence holds whole blocks
        sequences[str(context)] = budget // (tokens * per_token)
    return {
        "architecture": spec.architecture,
        "kv_cache": spec.kv_cache_geometry.describe(),
        "kv_bytes_per_token": per_token,
        "weight_bytes": weight_bytes,
        "kv_budget_bytes": budget,
        "sequences": sequences,
    }


def meta_weight_bytes(directory: str, dtype: torch.dtype) -> tuple[ModelSpec, int]:
    """The spec of `directory` and its weights' bytes at `dtype` (a model on the meta device)."""
    source = resolve_model(directory)
    spec = read_spec(source)
    model = build_model(spec, source, max_positions=16, dtype=dtype,
                        device=torch.device("meta"), load_format="dummy")  # fmt: skip
    return spec, sum(p.numel() * p.element_size() for p in model.parameters())


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("models", nargs="+", help="config directories (benchmarks/configs/...)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--memory-gib", type=float, default=139.0, help="device memory (H200: 139)")
    ap.add_argument("--fraction", type=float, default=0.85, help="kv_memory_fraction")
    ap.add_argument("--kv-dtype-bytes", type=int, default=2, choices=[1, 2])
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args(argv)
    if not 0 < args.fraction <= 1:
        raise ValueError(f"--fraction must be in (0, 1], got {args.fraction}")
    memory = int(args.memory_gib * GIB * args.fraction)
    rows = []
    for directory in args.models:
        row: dict = {"model": Path(directory).name, "usable_bytes": memory}
        try:
            spec, weights = meta_weight_bytes(directory, torch.bfloat16)
            row.update(kv_capacity(spec, weights, memory, args.contexts, args.kv_dtype_bytes,
                                   args.block_size))  # fmt: skip
        except ValueError as exc:  # an architecture this checkout does not know yet
            row["error"] = str(exc)
        rows.append(row)
    print(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
