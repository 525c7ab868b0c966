"""PD through the launcher on one GPU, prefill and decode nodes sharing it by memory fractions,
once per KV transport (cuda_ipc, nixl, zmq): Qwen2.5-7B dummy weights (bf16, no tokenizer:
token-id prompts; the same seed, so every transport must give the same greedy tokens), prompts
of 2k and 8k tokens. Prints, per transport and prompt length, the medians of the timing
record's `kv_transfer` (first KV frame or reservation to KV landed) and `kv_transfer_exposed`
(KV landed minus first token sampled) and TTFT, and checks the nixl stack logged the direct
path (NIXL WRITEs into the decode pool, no frames).

    python benchmarks/nixl_gpu_pd.py --out $OUT/nixl_pd.json

Leaves out: transfers across GPUs or hosts (one GPU: the copy is on-device through each
transport's path), and load (one request at a time)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.stack import PDStack, same_python_env  # noqa: E402

MODEL = ROOT / "benchmarks/configs/qwen2.5-7b-instruct"
TRANSPORTS = ("cuda_ipc", "nixl", "zmq")
LENGTHS = (2048, 8192)
PHASES = ("kv_transfer", "kv_transfer_exposed", "ttft")


def prompts(length: int, count: int) -> list[list[int]]:
    """Distinct token ids per prompt (no prefix-cache hit between them)."""
    return [[1000 + (i * 7919 + j * 31) % 100000 for j in range(length)] for i in range(count)]


def run(transport: str, count: int, log_dir: Path) -> dict:
    stack = PDStack(
        "--model", str(MODEL), "--load-format", "dummy", "--transport", transport,
        "--prefill-gpus", "0", "--decode-gpus", "0", "--prefill-gpu-memory-fraction", "0.4",
        "--decode-gpu-memory-fraction", "0.4",
        log_path=log_dir / f"{transport}.log", env=same_python_env(log_dir / "venv"),
    )  # fmt: skip
    try:
        out: dict = {"texts": {}, "phases": {}}
        for length in LENGTHS:
            texts, timings = [], []
            for prompt in [prompts(length, 1)[0], *prompts(length, count)]:  # first: warm-up
                body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
                r = httpx.post(stack.url + "/v1/completions", json=body, timeout=300)
                r.raise_for_status()
                texts.append(r.json()["choices"][0]["text"])
                timings.append(r.json()["timing"])
            out["texts"][length] = texts
            out["phases"][length] = {
                p: statistics.median(t[p] for t in timings[1:]) for p in PHASES
            }
        log = stack.log_path.read_text()
        out["direct"] = {
            "nixl": "nixl: KV to" in log and "is written straight into its pool" in log,
            "frames": "goes as frames" in log,
        }
        return out
    finally:
        stack.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/nixl_pd.json")
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = {t: run(t, args.requests, args.out.parent) for t in TRANSPORTS}
    reference = results[TRANSPORTS[0]]["texts"]
    same = {t: r["texts"] == reference for t, r in results.items()}
    args.out.write_text(json.dumps({"results": results, "same_tokens": same}, indent=1))
    print("transport  tokens  kv_transfer ms  exposed ms  TTFT ms  same greedy tokens")
    for t, r in results.items():
        for length in LENGTHS:
            ph = r["phases"][length]
            print(f"{t:9s} {length:7d} {ph['kv_transfer'] * 1e3:14.2f} "
                  f"{ph['kv_transfer_exposed'] * 1e3:11.2f} {ph['ttft'] * 1e3:8.1f}  {same[t]}")  # fmt: skip
    print("nixl direct path:", results["nixl"]["direct"])
    ok = all(same.values()) and results["nixl"]["direct"] == {"nixl": True, "frames": False}
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
