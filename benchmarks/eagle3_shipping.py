"""What shipping EAGLE-3's prompt hidden states costs, piece by piece, on the machine it runs on.

The prefill node keeps the target's aux hidden states of a prompt (`PromptAuxRows`), copies
them to the host after the prompt's last chunk, packs them into the KV completion header; the
decode node unpacks, checks and copies them to its device. None of it is in the TTFT (the
first token leaves first), but the prefill side runs on the prefill node's loop. Llama-3.1-8B
widths (3 x 4096 per token, bf16), a 512-token prompt (the most one request ships, 12 MiB)
and a 128-token one; medians of `--repeats`.

    python benchmarks/eagle3_shipping.py [--device cuda] [--out eagle3_shipping.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.engine.spec_decode.aux_rows import AUX_ROWS_KEY, PromptAuxRows, rows_from_wire  # noqa: E402
from kv_transfer.frames import CompleteHeader, decode_header, encode_header  # noqa: E402

WIDTH = 3 * 4096  # Llama-3.1-8B: three layers' hidden states per token


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one(tokens: int, device: torch.device) -> dict[str, float]:
    """Seconds of each piece for one request of `tokens` prompt positions."""
    rows = torch.randn(tokens, WIDTH, device=device).to(torch.bfloat16)
    keep = PromptAuxRows()
    keep.expect("r", tokens)
    keep.observe(["r"], [0], [tokens], rows)
    sync(device)
    t0 = time.perf_counter()
    wire = keep.to_wire("r")  # device -> host, bytes
    t1 = time.perf_counter()
    frame = encode_header(CompleteHeader("r", {"first_token": 1, AUX_ROWS_KEY: wire}))
    t2 = time.perf_counter()
    header = decode_header(frame)
    t3 = time.perf_counter()
    _, host = rows_from_wire(header.metadata[AUX_ROWS_KEY], WIDTH, tokens)
    host.to(device)
    sync(device)
    t4 = time.perf_counter()
    return {"to_host": t1 - t0, "pack": t2 - t1, "unpack": t3 - t2, "to_device": t4 - t3,
            "bytes": len(wire["data"])}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path("eagle3_shipping.json"))
    args = ap.parse_args()
    device = torch.device(args.device)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "width": WIDTH, "runs": {}}  # fmt: skip
    for tokens in (128, 512):
        one(tokens, device)  # warm-up
        runs = [one(tokens, device) for _ in range(args.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        result["runs"][tokens] = med
        parts = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in med.items() if k != "bytes")
        print(f"{tokens} positions ({med['bytes'] / 2**20:.1f} MiB): {parts}")
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
