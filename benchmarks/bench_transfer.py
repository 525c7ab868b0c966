"""KV transfer bandwidth: GB/s against payload size for the cuda_ipc and zmq transports (and nixl
with `--transports ... nixl`, where the nixl package is installed), next to
the raw peer-to-peer copy between the two GPUs and a raw ZMQ loopback stream, in one run.

    python benchmarks/bench_transfer.py [--sizes-mb 1 4 16 64 256 1024] [--repeats 5] \\
        [--transports cuda_ipc zmq] [--same-gpu] [--kv-cache-dtype fp8] \\
        [--out benchmarks/results/transfer]
    python benchmarks/bench_transfer.py --cpu-smoke     # no GPU: zmq between two CPU pools
    python benchmarks/bench_transfer.py --tp 2x1 1x2    # between tensor-parallel sizes
    python benchmarks/bench_transfer.py --replot benchmarks/results/transfer/transfer.json

Medians of --repeats, after one untimed warm-up per size; GB/s = payload bytes / time, 1e9 B.
  transport  begin(), send_layer() per layer (cuda_ipc bulk: one send_layers() for all layers, as
             for a short prefill step), complete(), then poll() until the sender says DONE
             ("send"). The receiver runs in a spawned process owning a pool on cuda:1 (cuda:0
             with --same-gpu) and reports the moment it turned the transfer DONE ("recv"; one
             host, one CLOCK_MONOTONIC). cuda_ipc direct: both mean the bytes are in the remote
             pool. zmq: sender DONE = the completion notice was handed to zmq; only "recv" says
             the bytes reached the receiver's pool.
  cuda_ipc data path
             the transport's copy kernel alone (DirectWriter.write_layers over the opened remote
             pool), timed like p2p with CUDA events: "all layers" is one launch for the whole
             payload, "per layer" one launch per layer as during a prefill. Excludes the host
             protocol (begin, notices, polling) that the transport rows include, and Python's
             launch time: the GPU sleeps until every launch is queued (it fails if it did not).
  p2p        dst.copy_(src), cuda:0 -> cuda:1 (-> cuda:0 with --same-gpu), CUDA events, after
             the same sleep.
  raw zmq    PUSH/PULL over tcp://127.0.0.1 into the same kind of process, from pinned host
             memory, one zero-copy frame per layer (the transport's framing); "send": zmq
             released the last frame, "recv": the receiver has the last byte.
  --tp PxD  P prefill ranks (a process each, its share of the KV heads, its GPU) into D decode
             ranks (one process, a pool per rank), each rank as a node's: every shipping rank
             writes its heads into the decode ranks holding them; receiver DONE once all did.
             Only p2p and these rows are measured (benchmarks/transfer_tp.py).
Pools: [layers, 2, blocks + 1, block_size, kv_heads, head_dim] in bf16 (float8_e4m3fn with
`--kv-cache-dtype fp8`: half the bytes per token), Qwen2.5-7B-shaped by default (57,344 bytes per
token in bf16); a payload is round(MiB / block bytes) blocks scattered at random over both
pools. The receiver zeroes its blocks before each transfer and checksums them after.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing
import pstats
import queue
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the repository's packages

from benchmarks.outputs import args_record, publish, pyplot  # noqa: E402
from kv_transfer import TransferConfig, TransferState, create_receiver, create_sender  # noqa: E402
from kv_transfer.cuda_ipc import CudaIpcSender  # noqa: E402

DEADLINE_S = 120.0
KV_DTYPES = {"auto": "bfloat16", "fp8": "float8_e4m3fn"}  # --kv-cache-dtype: the pools' dtype
HOLD_CYCLES = 50_000_000  # a GPU sleep of ~25 ms at ~2 GHz, while the host queues timed work
PEER_TIMEOUT_S = 180.0  # a spawned peer's start (CUDA init) or one transfer, at most


@dataclass(frozen=True)
class Layout:
    layers: int = 28
    kv_heads: int = 4
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"  # a torch dtype's name

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def bytes_per_token(self) -> int:  # K and V of every layer
        return self.layers * 2 * self.kv_heads * self.head_dim * self.torch_dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    def pool_shape(self, blocks: int) -> tuple[int, ...]:
        return (self.layers, 2, blocks + 1, self.block_size, self.kv_heads, self.head_dim)


def bits(pool: torch.Tensor) -> torch.Tensor:
    """The pool's bytes as integers of its element size (FP8 has no indexing kernels)."""
    return pool.view(torch.int16 if pool.element_size() == 2 else torch.uint8)


def checksum(pool: torch.Tensor, block_ids: list[int]) -> int:
    """Exact and order-sensitive: bits of the blocks (in `block_ids` order) times their position."""
    index = torch.tensor(block_ids, device=pool.device)
    total = 0
    for layer in range(pool.shape[0]):
        words = bits(pool[layer]).index_select(1, index).reshape(-1).to(torch.int64)
        weight = torch.arange(words.numel(), device=pool.device) % 65521 + layer + 1
        total += int((words * weight).sum())
    return total


# -- the receiving process ------------------------------------------------------------------


def _peer_main(kind: str, device: str, shape: tuple[int, ...], dtype: str, inbox, outbox) -> None:
    try:
        if kind == "raw_zmq":
            _serve_raw_zmq(inbox, outbox)
        else:
            _serve_transport(kind, torch.device(device), shape, dtype, inbox, outbox)
    except BaseException:
        outbox.put({"crash": traceback.format_exc()})


def _serve_transport(kind: str, device: torch.device, shape, dtype: str, inbox, outbox) -> None:
    """Own a pool, receive into it; answers handshakes whenever it polls, i.e. always."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pool = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
    expected: dict[str, list[int]] = {}
    config = TransferConfig(transport=kind, deadline_s=DEADLINE_S)
    with create_receiver(config, pool, "tcp://127.0.0.1:0") as receiver:
        outbox.put({"address": receiver.address})
        while True:
            for t in receiver.poll(timeout_s=0.001):
                ids = expected.pop(t.request_id)
                _synchronize(device)
                synced_at = time.monotonic()
                outbox.put(
                    {
                        "request_id": t.request_id,
                        "state": t.state.value,
                        "error": t.error,
                        "done_at": t.finished_at,
                        "synced_at": synced_at,
                        "checksum": checksum(pool, ids),
                    }
                )
            try:
                command = inbox.get_nowait()
            except queue.Empty:
                continue
            if command["op"] == "exit":
                return
            if command["op"] == "checksum":
                _synchronize(device)
                outbox.put({"checksum": checksum(pool, command["block_ids"])})
                continue
            ids = command["block_ids"]
            bits(pool)[:, :, ids] = 0
            _synchronize(device)  # a cuda_ipc sender writes from another process: no ordering
            receiver.expect(command["request_id"], ids)
            expected[command["request_id"]] = ids
            outbox.put({"expected": command["request_id"]})


def _serve_raw_zmq(inbox, outbox) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("tcp://127.0.0.1:0")
    outbox.put({"address": pull.getsockopt_string(zmq.LAST_ENDPOINT)})
    try:
        while (command := inbox.get())["op"] != "exit":
            outbox.put({"ready": True})
            got = 0
            for i in range(command["frames"]):
                if not pull.poll(int(PEER_TIMEOUT_S * 1000)):
                    raise TimeoutError(f"frame {i} of {command['frames']} never came")
                got += pull.recv(copy=False).buffer.nbytes
            outbox.put({"done_at": time.monotonic(), "bytes": got})
    finally:
        pull.close(linger=0)
        ctx.term()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Peer:
    """A spawned receiving process (never fork a process that holds CUDA) and its two queues."""

    def __init__(
        self, kind: str, device: torch.device, shape: tuple[int, ...], dtype: str = "bfloat16"
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=_peer_main,
            args=(kind, str(device), shape, dtype, self.inbox, self.outbox),
            daemon=True,
        )
        self.proc.start()
        self.address: str = self.get()["address"]

    def send(self, command: dict[str, Any]) -> None:
        self.inbox.put(command)

    def get(self) -> dict[str, Any]:
        try:
            message = self.outbox.get(timeout=PEER_TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError(
                f"the receiving process said nothing in {PEER_TIMEOUT_S} s"
            ) from None
        if "crash" in message:
            raise RuntimeError("the receiving process failed:\n" + message["crash"])
        return message

    def close(self) -> None:
        if self.proc.is_alive():
            self.inbox.put({"op": "exit"})
            self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the measurements -------------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    mb: float  # as asked (MiB)
    blocks: int
    nbytes: int  # the actual payload: blocks x block bytes


@dataclass
class Sample:  # seconds from the start of one transfer; None: not measured that way
    send: float | None = None
    recv: float | None = None
    recv_synced: float | None = None  # the receiver's device synchronized after its DONE
    ok: bool = True  # what arrived equals what was sent


def _measure(name: str, sizes: list[Size], repeats: int, per_size: Callable) -> list[dict]:
    """Per size: `per_size(size)` gives `once(rep) -> Sample`; one untimed warm-up, then
    `repeats` timed runs, reduced to medians and GB/s."""
    rows = []
    for size in sizes:
        once = per_size(size)
        samples = [once(rep) for rep in range(repeats + 1)]
        row: dict[str, Any] = {"size_mb": size.mb, "blocks": size.blocks, "bytes": size.nbytes}
        row["verified"] = all(sample.ok for sample in samples)
        for side in ("send", "recv", "recv_synced"):
            values = [v for sample in samples[1:] if (v := getattr(sample, side)) is not None]
            if values:
                row[f"{side}_s"] = statistics.median(values)
                row[f"{side}_gbps"] = size.nbytes / row[f"{side}_s"] / 1e9
                row[f"{side}_samples_s"] = values
        rows.append(row)
        _progress(name, row)
    return rows


def measure_p2p(sizes: list[Size], src: torch.device, dst: torch.device, repeats: int) -> list:
    most = max(s.nbytes for s in sizes)
    a = torch.randint(0, 256, (most,), dtype=torch.uint8, device=src)
    b = torch.empty(most, dtype=torch.uint8, device=dst)

    def per_size(size: Size) -> Callable[[int], Sample]:
        def once(rep: int) -> Sample:
            b[: size.nbytes].zero_()
            torch.cuda.synchronize(dst)
            with torch.cuda.device(src):  # the copy runs on the source's current stream
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                torch.cuda._sleep(HOLD_CYCLES)  # as for the data path (measure_data_path)
                start.record()
                b[: size.nbytes].copy_(a[: size.nbytes])
                end.record()
            torch.cuda.synchronize(src)
            torch.cuda.synchronize(dst)
            ok = rep < repeats or torch.equal(a[: size.nbytes].to(dst), b[: size.nbytes])
            return Sample(send=start.elapsed_time(end) / 1e3, ok=bool(ok))

        return once

    return _measure("p2p", sizes, repeats, per_size)


def measure_raw_zmq(sizes: list[Size], layout: Layout, repeats: int, pinned: bool) -> list:
    host = torch.randint(0, 256, (max(s.nbytes for s in sizes),), dtype=torch.uint8)
    array = (host.pin_memory() if pinned else host).numpy()
    with Peer("raw_zmq", torch.device("cpu"), ()) as peer:
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(peer.address)

        def per_size(size: Size) -> Callable[[int], Sample]:
            frame = size.nbytes // layout.layers  # block bytes are a multiple of layers

            def once(rep: int) -> Sample:
                peer.send({"op": "recv", "frames": layout.layers})
                peer.get()
                t0 = time.monotonic()
                for i in range(layout.layers):
                    chunk = array[i * frame : (i + 1) * frame]
                    tracker = push.send(chunk, copy=False, track=True)
                tracker.wait()  # frames leave in order: the last one released ends the send
                sent = time.monotonic() - t0
                report = peer.get()
                ok = report["bytes"] == frame * layout.layers
                return Sample(send=sent, recv=report["done_at"] - t0, ok=ok)

            return once

        try:
            return _measure("raw_zmq", sizes, repeats, per_size)
        finally:
            push.close(linger=0)
            ctx.term()


def measure_transport(
    kind: str, sizes: list[Size], src_pool: torch.Tensor, dst: torch.device, args, bulk=False
) -> tuple[list, dict[str, Any]]:
    """begin, the layers (one send_layer each, or with `bulk` one send_layers call, as a
    prefill node ships a short step), complete; until the sender and the receiver say DONE."""
    free_blocks = src_pool.shape[2] - 1  # the last block stands for the padding block
    rng = random.Random(args.seed)
    with Peer(kind, dst, tuple(src_pool.shape), _dtype_name(src_pool)) as peer:
        sender = create_sender(TransferConfig(transport=kind, deadline_s=DEADLINE_S), src_pool)
        route: dict[str, Any] = {}

        def per_size(size: Size) -> Callable[[int], Sample]:
            src_ids = rng.sample(range(free_blocks), size.blocks)
            dst_ids = rng.sample(range(free_blocks), size.blocks)
            want = checksum(src_pool, src_ids)

            def once(rep: int) -> Sample:
                rid = f"{kind}-{size.blocks}-{rep}"
                peer.send({"op": "expect", "request_id": rid, "block_ids": dst_ids})
                peer.get()
                t0 = time.monotonic()
                sender.begin(rid, peer.address, src_ids, dst_ids)
                layers = range(src_pool.shape[0])
                if bulk:
                    sender.send_layers(rid, layers)
                else:
                    for layer in layers:
                        sender.send_layer(rid, layer)
                sender.complete(rid, {"rep": rep})
                sent = _sender_done(sender, rid) - t0
                report = peer.get()
                if report["state"] != TransferState.DONE.value:
                    raise RuntimeError(f"{rid} failed on the receiver: {report['error']}")
                recv, synced = report["done_at"] - t0, report["synced_at"] - t0
                return Sample(sent, recv, synced, ok=report["checksum"] == want)

            return once

        try:
            if isinstance(sender, CudaIpcSender):  # handshake now, not inside the first timing
                found = sender.connect(peer.address)
                route = asdict(found) if found else {"direct": False, "reason": "unreachable"}
                if not route["direct"]:
                    print(f"WARNING: {kind} falls back to frames: {route['reason']}", flush=True)
            return _measure(kind + " bulk" * bulk, sizes, args.repeats, per_size), route
        finally:
            sender.close()  # drops the opened remote pool before its owner exits


def measure_data_path(
    sizes: list[Size], src_pool: torch.Tensor, dst: torch.device, args
) -> dict[str, list]:
    """The cuda_ipc copy kernel alone, CUDA events around it, the receiver checksumming."""
    free_blocks = src_pool.shape[2] - 1
    rng = random.Random(args.seed)
    layers = src_pool.shape[0]
    with Peer("cuda_ipc", dst, tuple(src_pool.shape), _dtype_name(src_pool)) as peer:
        sender = create_sender(
            TransferConfig(transport="cuda_ipc", deadline_s=DEADLINE_S), src_pool
        )
        try:
            sender.connect(peer.address)
            writer = sender.writer(peer.address)
            if writer is None:
                print("WARNING: no direct CUDA IPC path; data path not measured", flush=True)
                return {}

            def per_size(size: Size, per_layer: bool) -> Callable[[int], Sample]:
                src_ids = rng.sample(range(free_blocks), size.blocks)
                dst_ids = rng.sample(range(free_blocks), size.blocks)
                want = checksum(src_pool, src_ids)
                pairs = writer.block_pairs(src_ids, dst_ids)
                chunks = [range(i, i + 1) for i in range(layers)] if per_layer else [range(layers)]

                def once(rep: int) -> Sample:
                    torch.cuda.synchronize(src_pool.device)
                    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    # The GPU sleeps while the host queues every launch, so the events time
                    # the copies, not Python's launch overhead (which overlaps compute during
                    # a prefill); checked below: the sleep must outlast the queuing.
                    torch.cuda._sleep(HOLD_CYCLES)
                    start.record()
                    for chunk in chunks:
                        last = writer.write_layers(chunk, pairs)
                    torch.cuda.current_stream().wait_event(last)
                    end.record()
                    if rep and start.query():  # (the warm-up compiles the kernel meanwhile)
                        raise RuntimeError(
                            "the launches outlasted the GPU sleep: raise HOLD_CYCLES"
                        )
                    end.synchronize()
                    ok = True
                    if rep in (0, args.repeats):  # the warm-up and the last timed one
                        peer.send({"op": "checksum", "block_ids": dst_ids})
                        ok = peer.get()["checksum"] == want
                    return Sample(send=start.elapsed_time(end) / 1e3, ok=ok)

                return once

            return {
                "ipc_data_all": _measure(
                    "ipc all", sizes, args.repeats, lambda size: per_size(size, False)
                ),
                "ipc_data_layer": _measure(
                    "ipc layer", sizes, args.repeats, lambda size: per_size(size, True)
                ),
            }
        finally:
            sender.close()


def _dtype_name(pool: torch.Tensor) -> str:
    return str(pool.dtype).removeprefix("torch.")


def _sender_done(sender, request_id: str) -> float:
    until = time.monotonic() + DEADLINE_S
    while time.monotonic() < until:
        for t in sender.poll():
            if t.request_id == request_id:
                if t.state is not TransferState.DONE:
                    raise RuntimeError(f"{request_id} failed on the sender: {t.error}")
                return t.finished_at
    raise RuntimeError(f"{request_id}: the sender never reported it terminal")


def _progress(name: str, row: dict[str, Any]) -> None:
    parts = [f"{name:>8} {row['size_mb']:>7g} MiB ({row['blocks']} blocks)"]
    for side in ("send", "recv"):
        if f"{side}_gbps" in row:
            parts.append(f"{side} {row[f'{side}_gbps']:8.2f} GB/s")
    if not row.get("verified", True):
        parts.append("DATA MISMATCH")
    print("  ".join(parts), flush=True)


# -- report -----------------------------------------------------------------------------------

SERIES = [  # (result key, side, label, style)
    ("p2p", "send", "raw copy_ (CUDA events)", "k-o"),
    ("raw_zmq", "recv", "raw ZMQ PUSH/PULL, recv", "C2--s"),
    ("ipc_data_all", "send", "cuda_ipc copy kernel, all layers (CUDA events)", "C3-o"),
    ("ipc_data_layer", "send", "cuda_ipc copy kernel, per layer (CUDA events)", "C3:o"),
    ("cuda_ipc", "send", "cuda_ipc, sender DONE", "C0-^"),
    ("cuda_ipc", "recv", "cuda_ipc, receiver DONE", "C0--v"),
    ("cuda_ipc_bulk", "recv", "cuda_ipc, one send_layers, receiver DONE", "C4--v"),
    ("zmq", "send", "zmq, sender DONE", "C1-^"),
    ("zmq", "recv", "zmq, receiver DONE", "C1--v"),
    ("nixl", "recv", "nixl WRITEs, receiver DONE", "C5--v"),
]


def print_table(result: dict[str, Any]) -> None:
    runs = result["runs"]
    cols = [(k, side) for k, side, _, _ in SERIES if k in runs]
    head = " ".join(f"{k + ' ' + side:>15}" for k, side in cols)
    p2p = f"; p2p = {result['p2p_label']}" if "p2p" in runs else ""
    print(f"\nGB/s (1e9 B/s), median of {result['args']['repeats']}{p2p}")
    # Shares of the raw peer copy: (label, run, side), where both were measured.
    ratios = [
        (label, key, side)
        for label, key, side in (
            ("kernel/p2p", "ipc_data_all", "send"),
            ("layers/p2p", "ipc_data_layer", "send"),
            ("ipc/p2p", "cuda_ipc", "recv"),
            ("bulk/p2p", "cuda_ipc_bulk", "recv"),
            ("nixl/p2p", "nixl", "recv"),
        )
        if "p2p" in runs and key in runs
    ]
    tail = "".join(f" {label:>10}" for label, _, _ in ratios)
    print(f"{'MiB':>7} {'blocks':>6} {'bytes':>11} {head}{tail}")
    for i, size in enumerate(result["sizes"]):
        cells = []
        for k, side in cols:
            value = runs[k][i].get(f"{side}_gbps")
            flag = "" if runs[k][i].get("verified", True) else "!"
            cells.append(f"{value:>14.2f}{flag or ' '}" if value is not None else f"{'-':>15}")
        line = f"{size['mb']:>7g} {size['blocks']:>6} {size['nbytes']:>11} " + " ".join(cells)
        for _, key, side in ratios:
            line += f" {runs[key][i][f'{side}_gbps'] / runs['p2p'][i]['send_gbps']:>10.0%}"
        print(line)
    for kind, route in result.get("routes", {}).items():
        direct = "NIXL WRITEs" if kind == "nixl" else "direct CUDA IPC"
        how = direct if route.get("direct") else f"FRAMES: {route.get('reason')}"
        print(f"{kind} route: {how} {route.get('device', '')}")
    if any(not r.get("verified", True) for rows in runs.values() for r in rows):
        print("! = the data that arrived differs from what was sent")


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        print(f"matplotlib is not installed: no plot; later: --replot {path.with_suffix('.json')}")
        return
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for key, side, label, style in SERIES:
        rows = result["runs"].get(key)
        if not rows:
            continue
        if key == "p2p":
            label = result["p2p_label"]
        if not result["routes"].get(key, {}).get("direct", True):
            label += " (frames fallback, not IPC)"
        xs = [r["bytes"] / 2**20 for r in rows]
        ax.plot(xs, [r.get(f"{side}_gbps") for r in rows], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = [size["nbytes"] / 2**20 for size in result["sizes"]]
    ax.set_xticks(ticks, [f"{t:.3g}" for t in ticks])
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(  # label 2x and 5x between decades, no more
        matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else "")
    )
    ax.set_xlabel("payload per request (MiB)")
    ax.set_ylabel("GB/s (payload bytes / time)")
    ax.set_title(f"KV transfer bandwidth: {result['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    note = f"begin() to DONE, median; recv: the receiving process's DONE; {result['layout']}"
    fig.text(0.01, 0.01, note, fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# -- main -------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=None, help="payloads (MiB)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--transports", nargs="+", choices=["cuda_ipc", "zmq", "nixl"], default=None)
    ap.add_argument("--same-gpu", action="store_true", help="receiver pool on cuda:0 too")
    ap.add_argument("--tp", type=_tp_pair, nargs="+", metavar="PxD",
                    help="tensor-parallel pairs instead, prefill x decode ranks: 2x1 1x2")  # fmt: skip
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU pools, no p2p; for no-GPU hosts")
    ap.add_argument("--layers", type=int, default=Layout.layers)
    ap.add_argument("--kv-heads", type=int, default=Layout.kv_heads)
    ap.add_argument("--head-dim", type=int, default=Layout.head_dim)
    ap.add_argument("--block-size", type=int, default=Layout.block_size)
    ap.add_argument("--kv-cache-dtype", choices=list(KV_DTYPES), default="auto",
                    help="the pools' dtype, as the engine flag: auto = bf16, fp8 = e4m3")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--profile", action="store_true", help="cProfile the transports' host side: <out>/*.prof"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/transfer")
    ap.add_argument("--replot", type=Path, help="only redraw the plot and table of a JSON result")
    args = ap.parse_args()
    if args.sizes_mb is None:
        args.sizes_mb = [1, 4, 16] if args.cpu_smoke else [1, 4, 16, 64, 256, 1024]
    if args.transports is None:
        args.transports = ["zmq"] if args.cpu_smoke else ["cuda_ipc", "zmq"]
    if args.repeats < 1 or min(args.sizes_mb) <= 0:
        ap.error("--repeats must be >= 1 and every size > 0")
    return args


def _tp_pair(text: str) -> tuple[int, int]:
    """ "2x1" -> (2, 1): prefill ranks x decode ranks."""
    p, _, d = text.lower().partition("x")
    if not (p.isdigit() and d.isdigit() and int(p) >= 1 and int(d) >= 1):
        raise argparse.ArgumentTypeError(f"a TP pair is PxD, e.g. 2x1, not {text!r}")
    return int(p), int(d)


def main() -> None:
    args = parse_args()
    if args.replot:
        result = json.loads(args.replot.read_text())
        if "tp_runs" in result:
            from benchmarks import transfer_tp

            transfer_tp.plot(result, args.replot.with_suffix(".png"))
            transfer_tp.print_table(result)
            return
        plot(result, args.replot.with_suffix(".png"))
        print_table(result)
        return
    gpus = torch.cuda.device_count()
    if args.cpu_smoke:
        src, dst = torch.device("cpu"), torch.device("cpu")
    elif gpus >= 2 and not args.same_gpu:
        src, dst = torch.device("cuda", 0), torch.device("cuda", 1)
    elif gpus >= 1 and args.same_gpu:
        src, dst = torch.device("cuda", 0), torch.device("cuda", 0)
    else:
        sys.exit(
            f"bench_transfer: {gpus} CUDA GPU(s) visible; cuda:0 -> cuda:1 needs 2. "
            "Pass --same-gpu to measure within cuda:0 (needs 1), or --cpu-smoke without a GPU."
        )
    layout = Layout(
        args.layers, args.kv_heads, args.head_dim, args.block_size, KV_DTYPES[args.kv_cache_dtype]
    )
    sizes = [Size(mb, b, b * layout.block_bytes) for mb, b in _blocks(args.sizes_mb, layout)]
    device = "CPU" if src.type == "cpu" else torch.cuda.get_device_name(src)
    print(
        f"{device}: {src} -> {dst}, {layout}, {layout.block_bytes} bytes/block, "
        f"{layout.bytes_per_token} bytes/token",
        flush=True,
    )
    result: dict[str, Any] = {
        "args": args_record(args),
        "device": f"{device}, {src} -> {dst}",
        "layout": asdict(layout),
        "kv_bytes_per_token": layout.bytes_per_token,
        "sizes": [asdict(s) for s in sizes],
        "p2p_label": f"raw copy_ {src} -> {dst} (CUDA events)",
        "runs": {},
        "routes": {},
    }
    if src.type == "cuda":
        result["peer_access"] = src == dst or torch.cuda.can_device_access_peer(
            src.index, dst.index
        )
        result["runs"]["p2p"] = measure_p2p(sizes, src, dst, args.repeats)
        torch.cuda.empty_cache()  # its buffers are gone: give the transports the memory
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tp:
        from benchmarks import transfer_tp  # it imports this module's helpers

        result.update(transfer_tp.measure(args, sizes, layout, 0 if args.cpu_smoke else gpus))
        publish(result, args.out / "transfer_tp.json", transfer_tp.plot, transfer_tp.print_table)
        return
    result["runs"]["raw_zmq"] = measure_raw_zmq(sizes, layout, args.repeats, src.type == "cuda")
    shape = layout.pool_shape(max(s.blocks for s in sizes))
    src_pool = torch.randn(shape, dtype=torch.bfloat16, device=src).to(layout.torch_dtype)
    if "cuda_ipc" in args.transports and src.type == "cuda":
        result["runs"].update(measure_data_path(sizes, src_pool, dst, args))
    for kind in args.transports:
        profile = cProfile.Profile() if args.profile else None
        if profile is not None:
            profile.enable()
        rows, route = measure_transport(kind, sizes, src_pool, dst, args)
        if profile is not None:
            profile.disable()
            profile.dump_stats(args.out / f"{kind}.prof")
            stats = pstats.Stats(profile).sort_stats("tottime")
            print(f"\n{kind}: the sender's host time by function (all sizes and repeats)")
            stats.print_stats(18)
        result["runs"][kind] = rows
        if route:
            result["routes"][kind] = route
        if kind == "cuda_ipc" and src.type == "cuda":
            result["runs"]["cuda_ipc_bulk"] = measure_transport(
                kind, sizes, src_pool, dst, args, bulk=True
            )[0]
    path = args.out / "transfer.json"
    publish(result, path, plot, print_table)


def _blocks(sizes_mb: list[float], layout: Layout) -> list[tuple[float, int]]:
    return [(mb, max(1, round(mb * 2**20 / layout.block_bytes))) for mb in sizes_mb]


if __name__ == "__main__":
    main()
