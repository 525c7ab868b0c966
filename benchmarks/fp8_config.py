"""A model config stating block-wise FP8 weights (Qwen3-*-FP8's `quantization_config`), written
from a bf16 one: its dummy weights quantize at load in 128 x 128 blocks
(`common/model/quantization/config.py`, `resolve_quantization`), so the benchmarks run an FP8
checkpoint's layout without its weights.

    python benchmarks/fp8_config.py benchmarks/configs/qwen3-8b /tmp/qwen3-8b-fp8 [--tiny]

`--tiny` shrinks the shapes (two layers, 256 wide) for a CPU smoke run; `--plain` leaves the
weights unquantized (the bf16 baseline of the same shapes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BLOCK_FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 1024, "max_position_embeddings": 4096}  # fmt: skip


def write_block_config(src: Path, dst: Path, tiny: bool = False, plain: bool = False) -> Path:
    """`dst`/config.json: `src`'s config.json (only that file) with block-wise FP8 weights
    (`plain`: without)."""
    config = json.loads((Path(src) / "config.json").read_text())
    if "quantization_config" in config:
        raise ValueError(f"{src} already states a quantization: {config['quantization_config']}")
    if not plain:
        config["quantization_config"] = BLOCK_FP8
    if tiny:
        config.update(TINY)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="a config directory (benchmarks/configs/...)")
    ap.add_argument("dst", type=Path)
    ap.add_argument("--tiny", action="store_true", help="small shapes, for CPU smoke runs")
    ap.add_argument("--plain", action="store_true", help="no quantization_config")
    args = ap.parse_args()
    print(write_block_config(args.src, args.dst, args.tiny, args.plain))


if __name__ == "__main__":
    main()
