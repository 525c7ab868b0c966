"""The cuda_ipc transport's direct path: CUDA IPC writes between processes, devices, streams.

Run: `python -m pytest tests/test_kv_transfer_cuda_ipc_gpu.py -v -rs`. With one GPU the same-device
tests run and the cross-device ones skip; with two GPUs (peer access between cuda:0 and cuda:1)
all run. Each test takes a few seconds (mostly starting a process and CUDA in it).

The decode side runs in a process started with multiprocessing's spawn context (never fork a
process that holds CUDA). It owns its pool, builds a CudaIpcReceiver, and reports through a
queue what landed; only addresses, ids, flags and strings cross the process boundary, never
tensors. The expected values are recomputed there from the seeds both sides use. The sender
(prefill side) runs in the pytest process on cuda:0.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import queue
import random
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from test_kv_transfer import (  # tests/ is on sys.path under pytest
    FP8,
    FP8_FORMAT,
    MAPPINGS,
    NUM_BLOCKS,
    NUM_LAYERS,
    SHAPE,
    blocks,
    handshake,
    make_pool,
    poll_both_until_terminal,
    poll_sender_until_terminal,
    poll_until_terminal,
    raw_blocks,
)
from test_kv_transfer_cuda_ipc import ADDRESS

from kv_transfer import TransferConfig, TransferState
from kv_transfer.cuda_ipc import CANCELLED, CudaIpcReceiver, CudaIpcSender, Route
from kv_transfer.ipc_sender import CANCELLED_BY_RECEIVER

needs_gpu = pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (cross-device IPC)"
)
GPU_CONFIG = TransferConfig(transport="cuda_ipc", deadline_s=60.0)


def _decode_process(device, mapping, scenario, grace_s, inbox, outbox) -> None:
    """The decode side, in a spawned process: owns a bf16 pool on `device` (random with seed 2,
    or zeros for "fill"), expects `mapping`'s requests, serves until they end, and reports what
    landed. "cancel": on the parent's word, cancels "r" and reports what happens."""
    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        if scenario == "fill":
            pool = torch.zeros(SHAPE, dtype=torch.bfloat16, device=dev)
        else:
            pool = make_pool(torch.bfloat16, seed=2).to(dev)
        before = pool.cpu()
        with CudaIpcReceiver(pool, GPU_CONFIG, ADDRESS, cancel_grace_s=grace_s) as receiver:
            for rid, (_, dst_ids) in mapping.items():
                receiver.expect(rid, dst_ids)
            outbox.put({"address": receiver.address})
            report: dict[str, Any] = {}
            if scenario == "cancel":
                assert _serve(receiver, inbox, until_word="cancel") == []
                report["cancel_returned"] = receiver.cancel("r")
                cancelled_at = time.monotonic()
                quiet = _serve(receiver, inbox, for_s=0.5)
                outbox.put({"cancel_returned": report["cancel_returned"], "quiet": quiet})
            ended = poll_until_terminal(receiver, set(mapping))
            if scenario == "cancel":
                report["ended_after_s"] = time.monotonic() - cancelled_at
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            report["transfers"] = {
                rid: {"state": t.state.value, "error": t.error, "metadata": t.metadata}
                for rid, t in ended.items()
            }
            report["exact"] = _landed_exactly(pool.cpu(), before, mapping, scenario)
            outbox.put(report)
            _serve(receiver, inbox, until_word="exit")  # the sender drops its mapping first
    except BaseException:
        outbox.put({"error": traceback.format_exc()})


def _serve(receiver, inbox, until_word: str | None = None, for_s: float = 60.0) -> list[str]:
    """Poll the receiver (it answers handshakes only then) until a word or a time; returns the
    ids of transfers that ended meanwhile."""
    ended: list[str] = []
    until = time.monotonic() + for_s
    while time.monotonic() < until:
        ended += [t.request_id for t in receiver.poll(timeout_s=0.01)]
        if until_word is None:
            continue
        try:
            if inbox.get_nowait() == until_word:
                return ended
        except queue.Empty:
            pass
    assert until_word is None, f"never told {until_word!r}"
    return ended


def _landed_exactly(pool, before, mapping, scenario) -> dict[str, bool]:
    src = make_pool(torch.bfloat16, seed=1)  # what the parent's sender pool holds
    exact: dict[str, bool] = {}
    for rid, (src_ids, dst_ids) in mapping.items():
        if scenario == "fill":
            layers = [torch.full_like(blocks(pool, dst_ids)[0], i + 1) for i in range(NUM_LAYERS)]
            want = torch.stack(layers)
            exact[rid] = torch.equal(blocks(pool, dst_ids), want)
        else:
            exact[rid] = torch.equal(blocks(pool, dst_ids), blocks(src, src_ids))
    written = {b for _, dst_ids in mapping.values() for b in dst_ids}
    untouched = [b for b in range(NUM_BLOCKS) if b not in written]
    exact["untouched"] = torch.equal(blocks(pool, untouched), blocks(before, untouched))
    return exact


@dataclass
class DecodePeer:
    address: str
    inbox: Any
    outbox: Any

    def get(self) -> dict[str, Any]:
        message = self.outbox.get(timeout=60)
        assert "error" not in message, "decode process failed:\n" + message["error"]
        return message


@contextmanager
def decode_process(
    device: str, mapping: dict, scenario: str = "copy", grace_s: float = 30.0
) -> Iterator[DecodePeer]:
    ctx = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(
        target=_decode_process,
        args=(device, mapping, scenario, grace_s, inbox, outbox),
        daemon=True,
    )
    proc.start()
    try:
        peer = DecodePeer("", inbox, outbox)
        peer.address = peer.get()["address"]
        yield peer
    finally:
        inbox.put("exit")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def sender_pool(seed_or_zeros: int | None = 1) -> torch.Tensor:
    if seed_or_zeros is None:
        return torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda:0")
    return make_pool(torch.bfloat16, seed=seed_or_zeros).to("cuda:0")


def run_shuffled_transfers(sender: CudaIpcSender, address: str, bulk: bool = False) -> None:
    """Layers one by one in shuffled order, or (bulk) the last one alone, then one
    `send_layers` call for the others, as a prefill node ships a short step."""
    for rid, (src_ids, dst_ids) in MAPPINGS.items():
        sender.begin(rid, address, src_ids, dst_ids)
    if bulk:
        for rid in MAPPINGS:
            sender.send_layer(rid, NUM_LAYERS - 1)
            sender.send_layers(rid, range(NUM_LAYERS - 1))
    sends = [] if bulk else [(rid, layer) for rid in MAPPINGS for layer in range(NUM_LAYERS)]
    random.Random(0).shuffle(sends)
    for rid, layer in sends:
        sender.send_layer(rid, layer)
    for rid in MAPPINGS:
        sender.complete(rid, {"first_token": ord(rid)})
    sent = poll_sender_until_terminal(sender, set(MAPPINGS))
    assert {t.state for t in sent.values()} == {TransferState.DONE}


def assert_landed(report: dict[str, Any]) -> None:
    for rid in MAPPINGS:
        t = report["transfers"][rid]
        assert t["state"] == "done", t["error"]
        assert t["metadata"] == {"first_token": ord(rid)}
    assert all(report["exact"].values()), report["exact"]


def require_peer_access(device: int) -> None:
    if device != 0 and not torch.cuda.can_device_access_peer(0, device):
        pytest.skip(f"cuda:0 has no peer access to cuda:{device}: the sender would fall back")


def test_two_process_harness_on_cpu_takes_the_frames_fallback():
    """The GPU tests' two-process harness, run on CPU pools: real processes, frames fallback."""
    pool = make_pool(torch.bfloat16, seed=1)
    with decode_process("cpu", MAPPINGS) as peer, CudaIpcSender(pool, GPU_CONFIG) as sender:
        route = sender.connect(peer.address)
        assert route is not None and not route.direct and "on cpu" in route.reason
        run_shuffled_transfers(sender, peer.address)
        assert_landed(peer.get())


@needs_gpu
@pytest.mark.parametrize("bulk", [False, True])
@pytest.mark.parametrize("device", [0, pytest.param(1, marks=needs_two_gpus)])
def test_gpu_ipc_between_processes_writes_shuffled_layers_exactly(device, bulk):
    """Receiver in its own process on cuda:`device`, sender here on cuda:0: same GPU (0) or
    peer to peer across GPUs (1). The sender must take the IPC path, not the fallback."""
    require_peer_access(device)
    cuda = f"cuda:{device}"
    with decode_process(cuda, MAPPINGS) as peer, CudaIpcSender(sender_pool(), GPU_CONFIG) as s:
        route = s.connect(peer.address)
        assert route == Route(direct=True, reason="", device=f"cuda:{device}"), route
        run_shuffled_transfers(s, peer.address, bulk)
        assert_landed(peer.get())


@needs_gpu
@pytest.mark.parametrize("device", [0, pytest.param(1, marks=needs_two_gpus)])
def test_gpu_send_layer_returns_at_once_and_ships_what_the_current_stream_wrote_last(device):
    """send_layer while the compute stream is still busy: the copy must wait for the values
    queued before the call (the side stream waits on an event), and the call must not wait."""
    require_peer_access(device)
    mapping = {"warm": ([5, 6], [9, 10]), "r": ([3, 4], [4, 6])}
    with decode_process(f"cuda:{device}", mapping, scenario="fill") as peer:
        src = sender_pool(None)
        with CudaIpcSender(src, GPU_CONFIG) as sender:
            # A first transfer of the same size fills the allocators' caches (side-stream blocks,
            # pinned block-pair buffers) and compiles the copy kernel, so the timed one does
            # neither.
            for layer in range(NUM_LAYERS):
                src[layer, :, 5:7].fill_(layer + 1)
            sender.begin("warm", peer.address, *mapping["warm"])
            assert sender.route(peer.address).direct
            for layer in range(NUM_LAYERS):
                sender.send_layer("warm", layer)
            sender.complete("warm", {"first_token": 0})
            assert poll_sender_until_terminal(sender, {"warm"})["warm"].state.value == "done"

            sender.begin("r", peer.address, *mapping["r"])
            busy = torch.randn(4096, 4096, device="cuda:0")
            torch.cuda.synchronize()
            for layer in range(NUM_LAYERS):
                for _ in range(20):  # ~tens of ms of queued work per layer
                    busy = torch.tanh(busy @ busy)
                src[layer, :, 3:5].fill_(layer + 1)  # queued behind the matmuls (no list index:
                # indexing with a Python list would copy it to the GPU and synchronize)
                sender.send_layer("r", layer)
            assert not torch.cuda.current_stream().query(), "send_layer waited for compute"
            sender.complete("r", {"first_token": 1})
            (t,) = poll_sender_until_terminal(sender, {"r"}).values()
            assert t.state is TransferState.DONE
            report = peer.get()
    assert {t["state"] for t in report["transfers"].values()} == {"done"}
    assert all(report["exact"].values()), report["exact"]


@needs_gpu
def test_gpu_receiver_cancel_during_an_ipc_transfer_holds_blocks_until_the_sender_aborts():
    mapping = {"r": ([0, 1, 2], [3, 4, 5])}
    with decode_process("cuda:0", mapping, scenario="cancel", grace_s=30.0) as peer:
        with CudaIpcSender(sender_pool(), GPU_CONFIG) as sender:
            sender.begin("r", peer.address, *mapping["r"])
            assert sender.route(peer.address).direct
            sender.send_layer("r", 0)  # a direct write is issued
            peer.inbox.put("cancel")
            # The sender is not called meanwhile, so it cannot have answered the cancel.
            assert peer.get() == {"cancel_returned": False, "quiet": []}
            (t,) = poll_sender_until_terminal(sender, {"r"}).values()
            assert t.state is TransferState.FAILED and t.error == CANCELLED_BY_RECEIVER
            report = peer.get()
    ended = report["transfers"]["r"]
    assert ended["state"] == "failed" and ended["error"] == CANCELLED
    assert report["ended_after_s"] < 20, "ended by the sender's abort, not by the 30 s grace"


@needs_gpu
@pytest.mark.parametrize("device", [0, pytest.param(1, marks=needs_two_gpus)])
def test_gpu_in_process_pair_writes_directly(device):
    """Sender and receiver in one process (CUDA cannot open its own IPC handle): the sender
    uses the exported tensor itself, through the same writer."""
    require_peer_access(device)
    dst = make_pool(torch.bfloat16, seed=2).to(f"cuda:{device}")
    before = dst.clone()
    with CudaIpcReceiver(dst, GPU_CONFIG, ADDRESS) as receiver:
        with CudaIpcSender(sender_pool(), GPU_CONFIG) as sender:
            route = handshake(sender, receiver)
            assert route == Route(direct=True, reason="", device=f"cuda:{device}")
            for rid, (_, dst_ids) in MAPPINGS.items():
                receiver.expect(rid, dst_ids)
            run_shuffled_transfers(sender, receiver.address)
            done = poll_until_terminal(receiver, set(MAPPINGS))
    src = make_pool(torch.bfloat16, seed=1)
    for rid, (src_ids, dst_ids) in MAPPINGS.items():
        assert done[rid].state is TransferState.DONE and done[rid].layers_done == NUM_LAYERS
        assert torch.equal(blocks(dst.cpu(), dst_ids), blocks(src, src_ids))
    untouched = [b for b in range(NUM_BLOCKS) if b not in {5, 9, 3, 0, 1, 2, 11, 7}]
    assert torch.equal(blocks(dst, untouched), blocks(before, untouched))


@needs_gpu
def test_gpu_direct_abort_and_deadline_end_both_sides():
    dst = torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda:0")
    config = TransferConfig(transport="cuda_ipc", deadline_s=0.5)
    with CudaIpcReceiver(dst, config, ADDRESS, cancel_grace_s=30.0) as receiver:
        with CudaIpcSender(sender_pool(), config) as sender:
            assert handshake(sender, receiver).direct
            receiver.expect("aborted", [1])
            receiver.expect("slow", [2])
            sender.begin("aborted", receiver.address, [0], [1])
            sender.begin("slow", receiver.address, [3], [2])
            sender.send_layer("aborted", 0)
            sender.send_layer("slow", 0)
            sender.abort("aborted", "client went away")  # returns once its copy finished
            local = poll_sender_until_terminal(sender, {"aborted", "slow"})
            remote = poll_until_terminal(receiver, {"aborted", "slow"})
    assert local["aborted"].error == "client went away"
    assert remote["aborted"].error == "aborted by sender: client went away"
    assert local["slow"].error == "deadline exceeded"
    # The sender's abort ends it on the receiver, unless the receiver's own deadline (which began
    # at expect, earlier) made it ask the sender to stop first: either way only after the sender.
    assert remote["slow"].state is TransferState.FAILED
    assert remote["slow"].error in ("deadline exceeded", "aborted by sender: deadline exceeded")


@needs_gpu
def test_gpu_fp8_pools_are_written_directly_bit_exact():
    config = dataclasses.replace(GPU_CONFIG, kv_format=FP8_FORMAT)
    dst = make_pool(FP8, seed=2).to("cuda:0")
    src = make_pool(FP8, seed=1).to("cuda:0")
    with CudaIpcReceiver(dst, config, ADDRESS) as receiver, CudaIpcSender(src, config) as sender:
        assert handshake(sender, receiver).direct  # the copy kernel moves float8 as bytes
        for rid, (src_ids, dst_ids) in MAPPINGS.items():
            receiver.expect(rid, dst_ids)
            sender.begin(rid, receiver.address, src_ids, dst_ids)
            sender.send_layers(rid, range(NUM_LAYERS))
            sender.complete(rid, {})
        done, sent = poll_both_until_terminal(sender, receiver, set(MAPPINGS))
    assert {t.state for t in [*done.values(), *sent.values()]} == {TransferState.DONE}
    for src_ids, dst_ids in MAPPINGS.values():
        assert torch.equal(raw_blocks(dst, dst_ids), raw_blocks(src, src_ids))


@needs_gpu
def test_gpu_direct_completion_carries_its_payload_frame():
    """The direct path sends its completion after the copies; a payload (EAGLE-3's prompt
    rows, pinned host memory) goes with it, bytes intact, and the blocks land as without."""
    dst = make_pool(torch.bfloat16, seed=2).to("cuda:0")
    payload = torch.arange(3 << 20, dtype=torch.int32).pin_memory()  # 12 MiB
    with CudaIpcReceiver(dst, GPU_CONFIG, ADDRESS) as receiver:
        with CudaIpcSender(sender_pool(), GPU_CONFIG) as sender:
            assert handshake(sender, receiver).direct
            src_ids, dst_ids = MAPPINGS["a"]
            receiver.expect("a", dst_ids)
            sender.begin("a", receiver.address, src_ids, dst_ids)
            sender.send_layers("a", range(NUM_LAYERS))
            sender.complete("a", {"first_token": 7}, payload)
            done, sent = poll_both_until_terminal(sender, receiver, {"a"})
    assert done["a"].state is TransferState.DONE and sent["a"].state is TransferState.DONE
    assert done["a"].metadata["first_token"] == 7
    got = torch.frombuffer(bytearray(done["a"].payload), dtype=torch.int32)
    assert torch.equal(got, payload)
    assert torch.equal(
        blocks(dst.cpu(), dst_ids), blocks(make_pool(torch.bfloat16, seed=1), src_ids)
    )


@needs_gpu
def test_gpu_a_direct_writer_of_another_kv_format_is_refused_and_told_why():
    """Its "start" names the format: the receiver holds the blocks until the sender, told why
    in the "cancel", confirms its writes are over; both sides' errors name both formats."""
    theirs = dataclasses.replace(FP8_FORMAT, kv_scales="all 0.5")
    dst = torch.zeros(SHAPE, dtype=FP8, device="cuda:0")
    receiver_config = dataclasses.replace(GPU_CONFIG, kv_format=FP8_FORMAT)
    sender_config = dataclasses.replace(GPU_CONFIG, kv_format=theirs)
    with CudaIpcReceiver(dst, receiver_config, ADDRESS, cancel_grace_s=30.0) as receiver:
        with CudaIpcSender(make_pool(FP8, seed=1).to("cuda:0"), sender_config) as sender:
            assert handshake(sender, receiver).direct
            receiver.expect("r", [3, 4])
            sender.begin("r", receiver.address, [0, 1], [3, 4])
            sender.send_layer("r", 0)
            done, sent = poll_both_until_terminal(sender, receiver, {"r"})
    both = "kv_scales all 0.5 (prefill node, sender) vs all 1.0 (decode node, receiver)"
    assert done["r"].state is TransferState.FAILED and both in done["r"].error
    assert sent["r"].state is TransferState.FAILED and both in sent["r"].error
    assert sent["r"].error.startswith(CANCELLED_BY_RECEIVER)
