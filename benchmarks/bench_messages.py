"""CPU microbenchmark of the control-message codec (common/protocol/messages.py).

    python benchmarks/bench_messages.py [--tokens 8192] [--rows 32 128] [--repeats 2000]

Times, per message (median of --repeats, microseconds):
- PrefillRequest of --tokens prompt tokens: `encode` (the router, on its event loop) plus
  `decode` (the prefill node, validation included). Target: <= 300 us together.
- the router's one-time list -> int32 array conversion of the tokenizer's output, and the
  node's array -> list conversion for its Sequence (shown apart: not part of the codec);
- a decode step's TokenBatch of --rows rows: built, encoded, decoded and split per request.
Prints a table last; `--json PATH` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.protocol.messages import PrefillRequest, TokenBatch, decode, encode, int_array  # noqa: E402
from common.protocol.sampling_params import SamplingParams  # noqa: E402

TARGET_US = 300.0


def median_us(fn, repeats: int) -> float:
    for _ in range(min(20, repeats)):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def prefill_rows(tokens: int, repeats: int) -> dict[str, float]:
    rng = random.Random(0)
    ids = [rng.randrange(150_000) for _ in range(tokens)]
    array = int_array(ids)
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256)
    message = PrefillRequest("cmpl-" + "0" * 32, array, sampling, "tcp://d:1", "tcp://d:2")
    frame = encode(message)
    assert decode(frame).prompt_token_ids.tolist() == ids
    return {
        "tokens": tokens,
        "frame_bytes": len(frame),
        "encode_us": median_us(lambda: encode(message), repeats),
        "decode_us": median_us(lambda: decode(frame), repeats),
        "encode_decode_us": median_us(lambda: decode(encode(message)), repeats),
        "list_to_array_us": median_us(lambda: int_array(ids), max(50, repeats // 20)),
        "array_to_list_us": median_us(lambda: array.tolist(), max(50, repeats // 20)),
    }


def token_batch_row(rows: int, repeats: int) -> dict[str, float]:
    rids = [f"cmpl-{i:032x}" for i in range(rows)]
    tokens = list(range(rows))
    reasons = [None] * (rows - 1) + ["stop"]

    def step() -> int:
        frame = encode(TokenBatch(rids, tokens, reasons))
        return len(decode(frame).items())

    assert step() == rows
    return {"rows": rows, "build_encode_decode_split_us": median_us(step, repeats)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = {
        "prefill_request": prefill_rows(args.tokens, args.repeats),
        "token_batch": [token_batch_row(n, args.repeats // 4) for n in args.rows],
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    p = result["prefill_request"]
    verdict = "PASS" if p["encode_decode_us"] <= TARGET_US else "MISS"
    print(
        f"PrefillRequest {p['tokens']} tokens ({p['frame_bytes']} bytes): encode "
        f"{p['encode_us']:.1f} us + decode {p['decode_us']:.1f} us = "
        f"{p['encode_decode_us']:.1f} us [{verdict} <= {TARGET_US:.0f} us]"
    )
    print(
        f"  not in the codec: list -> int32 array {p['list_to_array_us']:.0f} us (router, once),"
        f" array -> list {p['array_to_list_us']:.0f} us (node, for its Sequence)"
    )
    for row in result["token_batch"]:
        print(
            f"TokenBatch {row['rows']:>4} rows: build + encode + decode + split "
            f"{row['build_encode_decode_split_us']:.1f} us"
        )


if __name__ == "__main__":
    main()
