"""What shipping EAGLE-3's prompt hidden states costs, piece by piece, on the machine it runs on.

The prefill node keeps the target's aux hidden states of a prompt (`PromptAuxRows`); after the
prompt's last chunk `to_wire` copies them into pinned host memory, and they travel as the KV
completion's payload frame behind its header (`KVSender.complete`), zero-copy on the send; the
decode node checks the frame's size, views the rows over it and copies them to its device.
None of it is in the TTFT (the first token leaves first), but the prefill side runs on the
prefill node's loop. Llama-3.1-8B widths (3 x 4096 per token, bf16), prompts of 512 and 8192
tokens (12 and 192 MiB); the wire is a real zmq PUSH/PULL pair over TCP on 127.0.0.1; medians
of `--repeats`.

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
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.engine.spec_decode.aux_rows import AUX_ROWS_KEY, PromptAuxRows, rows_from_wire  # noqa: E402
from kv_transfer.frames import completion_error, decode_header  # noqa: E402
from kv_transfer.frames_sender import completion_frames  # noqa: E402

WIDTH = 3 * 4096  # Llama-3.1-8B: three layers' hidden states per token


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one(tokens: int, device: torch.device, push: zmq.Socket, pull: zmq.Socket) -> dict[str, float]:
    """Seconds of each piece for one request of `tokens` prompt positions."""
    rows = torch.randn(tokens, WIDTH, device=device).to(torch.bfloat16)
    keep = PromptAuxRows()
    keep.expect("r", tokens)
    keep.observe(["r"], [0], [tokens], rows)
    sync(device)
    t0 = time.perf_counter()
    meta, payload = keep.to_wire("r")  # device -> pinned host
    t1 = time.perf_counter()
    push.send_multipart(completion_frames("r", {"first_token": 1, AUX_ROWS_KEY: meta}, payload),
                        copy=False)  # fmt: skip
    t2 = time.perf_counter()
    frames = pull.recv_multipart(copy=False)
    header = decode_header(frames[0].bytes)
    assert completion_error(header, len(frames), frames[1].buffer.nbytes) is None
    t3 = time.perf_counter()
    _, host = rows_from_wire(header.metadata[AUX_ROWS_KEY], frames[1].buffer, WIDTH, tokens)
    host.to(device)
    sync(device)
    t4 = time.perf_counter()
    return {"to_host": t1 - t0, "send": t2 - t1, "receive": t3 - t2, "to_device": t4 - t3,
            "bytes": payload.nbytes}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path("eagle3_shipping.json"))
    args = ap.parse_args()
    device = torch.device(args.device)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "width": WIDTH, "runs": {}}  # fmt: skip
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    for tokens in (512, 8192):
        one(tokens, device, push, pull)  # warm-up
        runs = [one(tokens, device, push, pull) for _ in range(args.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        result["runs"][tokens] = med
        parts = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in med.items() if k != "bytes")
        print(f"{tokens} positions ({med['bytes'] / 2**20:.1f} MiB): {parts}")
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
