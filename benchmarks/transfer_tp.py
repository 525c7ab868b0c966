"""KV transfer between tensor-parallel sizes, for `bench_transfer.py --tp PxD [PxD ...]`.

Each shipping prefill rank of a P-rank node is a spawned process holding its share of the KV
heads (`TPLayout.kv_heads`) on its own GPU (rank r: cuda:r mod GPUs) with its own sender,
configured as a node's rank is (`kv_transfer.tp.rank_transfer`). The D decode ranks are one
spawned process owning one pool per rank (rank q: cuda:(GPUs - 1 - q) mod GPUs, so that with two
GPUs every pairing writes across them), whose receiver is set up as a decode node's rank 0 is
(`kv_transfer.tp.tp_receiver`): cuda_ipc answers the senders with every rank's pool export
(`CudaIpcReceiver.share_ranks`), and frames reach each rank's pool through one writer (here
in-process, `RankPoolsWriter`; a node hands them to its rank processes instead).

One transfer: the receiver zeroes and expects the blocks; every sender is told to go at once and
runs begin, one send_layer per layer (as a prefill streams them), complete, then polls until
DONE. GB/s = the payload (every KV head of the model, as for TP 1) /
time from the earliest begin: "send" to the last sender's DONE, "recv" to the receiver's DONE
(one host, one CLOCK_MONOTONIC). Each decode rank's blocks are checksummed against the main
process's copy of the model's whole pool (`seeded_pool`: the same bytes in every process).
"""

from __future__ import annotations

import multiprocessing
import queue
import random
import secrets
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from benchmarks.bench_transfer import (
    DEADLINE_S,
    PEER_TIMEOUT_S,
    Layout,
    Sample,
    Size,
    _measure,
    _sender_done,
    _synchronize,
    bits,
    checksum,
)
from common.model.parallel import TPLayout
from kv_transfer import TransferConfig, TransferState, create_receiver, create_sender
from kv_transfer.cuda_ipc import CudaIpcSender
from kv_transfer.ipc_handles import export_or_refusal
from kv_transfer.pool_io import PoolWriter, write_heads
from kv_transfer.tp import rank_transfer, shipping_ranks


def tp_layout(size: int, kv_heads: int) -> TPLayout:
    """Only the KV heads matter here; the other sizes just divide."""
    return TPLayout(size, kv_heads * size, kv_heads, size, 1)


def seeded_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int):
    """Bytes that depend only on (seed, layer, position), made on any device: every process
    builds the same pool. Finite values (bf16 exponents below all-ones, no e4m3 NaN)."""
    pool = torch.empty(shape, dtype=dtype, device=device)
    words = bits(pool)
    span = 16384 if words.element_size() == 2 else 120
    index = torch.arange(words[0].numel(), device=device, dtype=torch.int64)
    for layer in range(shape[0]):
        mixed = (index * 2654435761 + (seed * 1000003 + layer) * 40503) % span
        words[layer].view(-1).copy_(mixed.to(words.dtype))
    return pool


def _heads_of(pool: torch.Tensor, heads: range) -> torch.Tensor:
    return pool[..., heads.start : heads.stop, :].contiguous()


def rank_devices(n: int, gpus: int, same_gpu: bool, decode: bool) -> list[str]:
    if gpus == 0:
        return ["cpu"] * n
    if same_gpu:
        return ["cuda:0"] * n
    return [f"cuda:{(gpus - 1 - r) % gpus if decode else r % gpus}" for r in range(n)]


class RankPoolsWriter(PoolWriter):
    """Every decode rank's pool in one process: a frame's heads go into each pool holding them
    (as `kv_transfer.tp.TPPoolWriter` and the ranks it commands do across processes)."""

    def __init__(self, pools: list[torch.Tensor], heads: list[range]) -> None:
        super().__init__(pools[0], heads[0])
        self.pools, self.rank_heads = pools, heads

    @property
    def num_heads(self) -> int:
        return max(h.stop for h in self.rank_heads)

    def write(self, layer: int, block_ids: list[int], head_start: int, payload: torch.Tensor):
        for pool, heads in zip(self.pools, self.rank_heads, strict=True):
            write_heads(pool, heads, layer, block_ids, head_start, payload)


# -- the spawned processes ---------------------------------------------------------------------


class Spawned:
    """A spawned process (never fork one that holds CUDA) and its two queues; `target` gets
    (*args, inbox, outbox) and puts {"crash": traceback} when it fails."""

    def __init__(self, target: Callable, *args: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=target, args=(*args, self.inbox, self.outbox), daemon=True)
        self.proc.start()

    def send(self, command: dict[str, Any]) -> None:
        self.inbox.put(command)

    def get(self) -> dict[str, Any]:
        try:
            message = self.outbox.get(timeout=PEER_TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError(f"a spawned peer said nothing in {PEER_TIMEOUT_S} s") from None
        if "crash" in message:
            raise RuntimeError("a spawned peer failed:\n" + message["crash"])
        return message

    def close(self) -> None:
        if self.proc.is_alive():
            self.inbox.put({"op": "exit"})
            self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _receiver_main(kind, devices, shape, dtype, kv_heads, inbox, outbox) -> None:
    """The decode node's ranks: a pool per rank, rank 0's receiver set up for all of them."""
    try:
        layout = tp_layout(len(devices), kv_heads)
        heads = [layout.kv_heads(q) for q in range(layout.size)]
        pools = []
        for device, own in zip(devices, heads, strict=True):
            rank_shape = (*shape[:4], len(own), shape[5])
            pools.append(torch.zeros(rank_shape, dtype=getattr(torch, dtype), device=device))
        config = TransferConfig(transport=kind, deadline_s=DEADLINE_S)
        with create_receiver(config, pools[0], "tcp://127.0.0.1:0") as receiver:
            if len(pools) > 1:
                receiver.set_writer(RankPoolsWriter(pools, heads))
                if kind == "cuda_ipc":  # what tp_receiver gathers from the rank processes
                    others = [export_or_refusal(p, secrets.token_hex(8)) for p in pools[1:]]
                    receiver.share_ranks([receiver.pool_export, *others], heads)
            outbox.put({"address": receiver.address})
            _serve(receiver, pools, inbox, outbox)
    except BaseException:
        outbox.put({"crash": traceback.format_exc()})


def _serve(receiver, pools: list[torch.Tensor], inbox, outbox) -> None:
    expected: dict[str, list[int]] = {}
    while True:
        for t in receiver.poll(timeout_s=0.001):
            ids = expected.pop(t.request_id)
            for pool in pools:
                _synchronize(pool.device)
            outbox.put({
                "state": t.state.value, "error": t.error, "done_at": t.finished_at,
                "checksums": [checksum(pool, ids) for pool in pools],
            })  # fmt: skip
        try:
            command = inbox.get_nowait()
        except queue.Empty:
            continue
        if command["op"] == "exit":
            return
        ids = command["block_ids"]
        for pool in pools:  # a direct sender writes from another process: no ordering
            bits(pool)[:, :, ids] = 0
            _synchronize(pool.device)
        receiver.expect(command["request_id"], ids)
        expected[command["request_id"]] = ids
        outbox.put({"expected": command["request_id"]})


def _sender_main(kind, rank, size, kv_heads, device, shape, dtype, seed, inbox, outbox) -> None:
    """One shipping prefill rank: its heads of the model's pool, its own sender."""
    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        layout = tp_layout(size, kv_heads)
        pool = _heads_of(
            seeded_pool(shape, getattr(torch, dtype), dev, seed), layout.kv_heads(rank)
        )
        config = rank_transfer(TransferConfig(transport=kind, deadline_s=DEADLINE_S), layout, rank)
        sender = create_sender(config, pool)
        outbox.put({"ready": rank})
        try:
            while (command := inbox.get())["op"] != "exit":
                if command["op"] == "connect":
                    route = None
                    if isinstance(sender, CudaIpcSender):
                        found = sender.connect(command["address"])
                        route = asdict(found) if found else {"direct": False, "reason": "?"}
                    outbox.put({"route": route})
                else:
                    outbox.put(_ship(sender, command, pool.shape[0]))
        finally:
            sender.close()  # drops the opened remote pools before their owner exits
    except BaseException:
        outbox.put({"crash": traceback.format_exc()})


def _ship(sender, command: dict[str, Any], layers: int) -> dict[str, Any]:
    rid = command["request_id"]
    begin_at = time.monotonic()
    sender.begin(rid, command["address"], command["src"], command["dst"])
    for layer in range(layers):
        sender.send_layer(rid, layer)
    sender.complete(rid, {})
    return {"begin_at": begin_at, "done_at": _sender_done(sender, rid)}


# -- the measurement ---------------------------------------------------------------------------


def measure_pair(
    kind: str, pair: tuple[int, int], sizes: list[Size], layout: Layout, args, gpus: int
) -> tuple[list[dict], dict[str, Any]]:
    """Rows as `bench_transfer._measure` makes them, and each sending rank's route."""
    p, d = pair
    shape = layout.pool_shape(max(s.blocks for s in sizes))
    dtype = layout.dtype
    main_device = torch.device("cuda:0" if gpus else "cpu")
    full = seeded_pool(shape, layout.torch_dtype, main_device, args.seed)
    decode_layout = tp_layout(d, layout.kv_heads)
    decode_heads = [decode_layout.kv_heads(q) for q in range(d)]
    ranks = shipping_ranks(tp_layout(p, layout.kv_heads))
    senders_on = rank_devices(p, gpus, args.same_gpu, decode=False)
    receiver = Spawned(_receiver_main, kind, rank_devices(d, gpus, args.same_gpu, decode=True),
                       shape, dtype, layout.kv_heads)  # fmt: skip
    senders = [
        Spawned(_sender_main, kind, r, p, layout.kv_heads, senders_on[r], shape, dtype, args.seed)
        for r in ranks
    ]
    try:
        address = receiver.get()["address"]
        for sender in senders:
            sender.get()
        routes = {}
        for r, sender in zip(ranks, senders, strict=True):
            sender.send({"op": "connect", "address": address})
            routes[f"prefill rank {r}"] = sender.get()["route"]
        rng = random.Random(args.seed)
        free_blocks = shape[2] - 1  # the last block stands for the padding block

        def per_size(size: Size) -> Callable[[int], Sample]:
            src_ids = rng.sample(range(free_blocks), size.blocks)
            dst_ids = rng.sample(range(free_blocks), size.blocks)
            want = [checksum(_heads_of(full, h), src_ids) for h in decode_heads]

            def once(rep: int) -> Sample:
                rid = f"{kind}-{p}x{d}-{size.blocks}-{rep}"
                receiver.send({"op": "expect", "request_id": rid, "block_ids": dst_ids})
                receiver.get()
                ship = {"op": "ship", "request_id": rid, "address": address, "src": src_ids,
                        "dst": dst_ids}  # fmt: skip
                for sender in senders:
                    sender.send(ship)
                shipped = [sender.get() for sender in senders]
                report = receiver.get()
                if report["state"] != TransferState.DONE.value:
                    raise RuntimeError(f"{rid} failed on the receiver: {report['error']}")
                t0 = min(s["begin_at"] for s in shipped)
                sent = max(s["done_at"] for s in shipped) - t0
                return Sample(sent, report["done_at"] - t0, ok=report["checksums"] == want)

            return once

        return _measure(f"{kind} {p}x{d}", sizes, args.repeats, per_size), routes
    finally:
        for peer in [*senders, receiver]:
            peer.close()


def measure(args, sizes: list[Size], layout: Layout, gpus: int) -> dict[str, Any]:
    """Every transport of `args.transports` for every pair of `args.tp`: runs and routes."""
    runs, routes = {}, {}
    for kind in args.transports:
        for pair in args.tp:
            key = f"{kind} P{pair[0]}xD{pair[1]}"
            runs[key], routes[key] = measure_pair(kind, pair, sizes, layout, args, gpus)
    return {"tp_runs": runs, "tp_routes": routes}


def print_table(result: dict[str, Any]) -> None:
    runs, p2p = result["tp_runs"], result["runs"].get("p2p")
    print(f"\nGB/s (1e9 B/s) at the receiver's DONE, median of {result['args']['repeats']}"
          + (f"; share of {result['p2p_label']}" if p2p else ""))  # fmt: skip
    keys = list(runs)
    print(f"{'MiB':>7} {'bytes':>11} " + " ".join(f"{k:>22}" for k in keys))
    for i, size in enumerate(result["sizes"]):
        cells = []
        for k in keys:
            row = runs[k][i]
            share = f" {row['recv_gbps'] / p2p[i]['send_gbps']:>5.0%}" if p2p else ""
            flag = "" if row.get("verified", True) else "!"
            cells.append(f"{row['recv_gbps']:>15.2f}{share}{flag:1}")
        print(f"{size['mb']:>7g} {size['nbytes']:>11} " + " ".join(f"{c:>22}" for c in cells))
    for key, routes in result["tp_routes"].items():
        for rank, route in routes.items():
            if route is not None:
                how = (
                    "direct " + route["device"] if route["direct"] else "FRAMES: " + route["reason"]
                )
                print(f"{key} {rank}: {how}")
    if any(not r.get("verified", True) for rows in runs.values() for r in rows):
        print("! = the data that arrived differs from what was sent")


def plot(result: dict[str, Any], path) -> None:
    from benchmarks.outputs import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    rows = result["runs"].get("p2p")
    if rows:
        ax.plot([r["bytes"] / 2**20 for r in rows], [r["send_gbps"] for r in rows], "k-o",
                label=result["p2p_label"])  # fmt: skip
    for key, rows in result["tp_runs"].items():
        ax.plot([r["bytes"] / 2**20 for r in rows], [r["recv_gbps"] for r in rows], "--v",
                label=f"{key}, receiver DONE")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("payload per request (MiB, every KV head)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"KV transfer between TP sizes: {result['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
