"""KV transfer transports end to end: real pools on CPU, real sockets on 127.0.0.1, no mocks.

The `transport` fixture runs each contract test on every transport that works on CPU: zmq,
loopback, and cuda_ipc, whose CPU pools always take its frames mode (its own contract, cancel
and the direct path: tests/test_kv_transfer_cuda_ipc.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import threading
import time

import msgpack
import pytest
import torch
import zmq

from common.engine.kv_format import KVFormat
from kv_transfer import (
    TRANSPORTS,
    KVReceiver,
    KVSender,
    Transfer,
    TransferConfig,
    TransferState,
    create_receiver,
    create_sender,
)
from kv_transfer.cuda_ipc import CudaIpcSender, Route
from kv_transfer.frames import MAX_HEADER_BYTES
from kv_transfer.loopback import LoopbackReceiver, LoopbackSender
from kv_transfer.pool_io import as_bytes, write_heads
from kv_transfer.zmq_transport import ZmqReceiver, ZmqSender

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 12, 4, 2, 8
SHAPE = (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
MAX_WAIT_S = 20.0  # only a hang reaches it
_names = itertools.count()

# For a contract where cuda_ipc differs: its receiver holds a cancelled or expired reservation
# until its sender confirms that nothing writes it any more (KVReceiver.cancel).
zmq_and_loopback_only = pytest.mark.parametrize("transport", ["zmq", "loopback"])


def make_pool(dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


def bind_address(transport: str) -> str:
    return f"loopback://test-{next(_names)}" if transport == "loopback" else "tcp://127.0.0.1:0"


def poll_until_terminal(receiver: KVReceiver, request_ids: set[str]) -> dict[str, Transfer]:
    seen: dict[str, Transfer] = {}
    until = time.monotonic() + MAX_WAIT_S
    while not request_ids <= seen.keys():
        assert time.monotonic() < until, f"never terminal: {sorted(request_ids - seen.keys())}"
        seen.update((t.request_id, t) for t in receiver.poll(timeout_s=0.02))
    return seen


def poll_both_until_terminal(
    sender: KVSender, receiver: KVReceiver, request_ids: set[str]
) -> tuple[dict[str, Transfer], dict[str, Transfer]]:
    """(receiver's, sender's) ended transfers. The sender must be polled too while the GPU
    works: a zmq sender pushes a staged layer only from a call made after its device-to-host
    copy finished."""
    done: dict[str, Transfer] = {}
    sent: dict[str, Transfer] = {}
    until = time.monotonic() + MAX_WAIT_S
    while not (request_ids <= done.keys() and request_ids <= sent.keys()):
        assert time.monotonic() < until, (
            f"never terminal: {request_ids - (done.keys() & sent.keys())}"
        )
        sent.update((t.request_id, t) for t in sender.poll())
        done.update((t.request_id, t) for t in receiver.poll(timeout_s=0.02))
    return done, sent


def poll_sender_until_terminal(sender: KVSender, request_ids: set[str]) -> dict[str, Transfer]:
    seen: dict[str, Transfer] = {}
    until = time.monotonic() + MAX_WAIT_S
    while not request_ids <= seen.keys():
        assert time.monotonic() < until, f"sender never terminal: {request_ids - seen.keys()}"
        seen.update((t.request_id, t) for t in sender.poll())
        time.sleep(0.005)
    return seen


def send_all(sender: KVSender, request_id: str, metadata: dict | None = None) -> None:
    for layer in range(NUM_LAYERS):
        sender.send_layer(request_id, layer)
    sender.complete(request_id, metadata or {})


def blocks(pool: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    return pool[:, :, block_ids]


def handshake(sender: CudaIpcSender, receiver: KVReceiver) -> Route:
    """connect() blocks until the receiver answers, and a receiver answers only inside poll():
    in a single-threaded test, serve it from a helper thread for the duration."""
    stop = threading.Event()
    returned: list[Transfer] = []

    def serve() -> None:
        while not stop.is_set():
            returned.extend(receiver.poll(timeout_s=0.01))

    server = threading.Thread(target=serve)
    server.start()
    try:
        route = sender.connect(receiver.address)
    finally:
        stop.set()
        server.join()
    assert returned == [], "nothing may end during a handshake"
    assert route is not None
    return route


@pytest.fixture(params=["zmq", "loopback", "cuda_ipc"])
def transport(request) -> str:
    return request.param


@pytest.fixture
def make_pair(transport):
    """Build (sender, receiver, src_pool, dst_pool) with the given config (a cuda_ipc pair has
    shaken hands); closes them after."""
    opened: list = []

    def make(dtype=torch.float32, dst_dtype=None, formats=(None, None), **config_kwargs):
        """`formats`: the sender's and the receiver's KVFormat (None: announced / checked not)."""
        config = TransferConfig(transport=transport, **config_kwargs)
        src, dst = make_pool(dtype, seed=1), make_pool(dst_dtype or dtype, seed=2)
        receiver_config = dataclasses.replace(config, kv_format=formats[1])
        receiver = create_receiver(receiver_config, dst, bind_address(transport))
        sender = create_sender(dataclasses.replace(config, kv_format=formats[0]), src)
        opened.extend([sender, receiver])
        if isinstance(sender, CudaIpcSender):
            handshake(sender, receiver)
        return sender, receiver, src, dst

    yield make
    for endpoint in opened:
        endpoint.close()


MAPPINGS = {  # request -> (source blocks, destination blocks)
    "a": ([0, 1, 2], [5, 9, 3]),
    "b": ([7], [0]),
    "c": ([4, 10, 11, 6], [1, 2, 11, 7]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_shuffled_layers_land_exactly_in_the_reserved_blocks(make_pair, dtype):
    sender, receiver, src, dst = make_pair(dtype)
    before = dst.clone()
    for rid, (src_ids, dst_ids) in MAPPINGS.items():
        receiver.expect(rid, dst_ids)
        sender.begin(rid, receiver.address, src_ids, dst_ids)
    sends = [(rid, layer) for rid in MAPPINGS for layer in range(NUM_LAYERS)]
    random.Random(0).shuffle(sends)
    for rid, layer in sends:
        sender.send_layer(rid, layer)
    for rid in MAPPINGS:
        sender.complete(rid, {"first_token": ord(rid), "timing": {"prefill_compute": 0.25}})

    done = poll_until_terminal(receiver, set(MAPPINGS))
    for rid, (src_ids, dst_ids) in MAPPINGS.items():
        assert done[rid].state is TransferState.DONE, done[rid].error
        assert done[rid].metadata == {"first_token": ord(rid), "timing": {"prefill_compute": 0.25}}
        assert done[rid].layers_done == NUM_LAYERS
        assert torch.equal(blocks(dst, dst_ids), blocks(src, src_ids))
    written = {b for _, dst_ids in MAPPINGS.values() for b in dst_ids}
    untouched = [b for b in range(NUM_BLOCKS) if b not in written]
    assert torch.equal(blocks(dst, untouched), blocks(before, untouched))

    sent = poll_sender_until_terminal(sender, set(MAPPINGS))
    assert {t.state for t in sent.values()} == {TransferState.DONE}
    assert sender.poll() == []  # reported once, then forgotten


FP8 = torch.float8_e4m3fn
FP8_FORMAT = KVFormat(
    kv_dtype="float8_e4m3fn",
    kv_scales="all 1.0",
    quantization="none",
    architecture="LlamaForCausalLM",
    num_layers=NUM_LAYERS,
    planes=2,
    num_kv_heads=HEADS,
    head_dim=HEAD_DIM,
    block_size=BLOCK_SIZE,
)


def raw_blocks(pool: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """The blocks' bytes: equal bytes is what bit exact means (and float8 has NaNs)."""
    return blocks(pool, block_ids).view(torch.uint8)


def test_fp8_pools_of_one_format_arrive_bit_exact(make_pair):
    sender, receiver, src, dst = make_pair(FP8, formats=(FP8_FORMAT, FP8_FORMAT))
    before = dst.clone()
    for rid, (src_ids, dst_ids) in MAPPINGS.items():
        receiver.expect(rid, dst_ids)
        sender.begin(rid, receiver.address, src_ids, dst_ids)
        sender.send_layers(rid, range(1, NUM_LAYERS))  # the announcing frame is not layer 0
        sender.send_layer(rid, 0)
        sender.complete(rid, {})
    done, sent = poll_both_until_terminal(sender, receiver, set(MAPPINGS))
    assert {t.state for t in [*done.values(), *sent.values()]} == {TransferState.DONE}
    for src_ids, dst_ids in MAPPINGS.values():
        assert torch.equal(raw_blocks(dst, dst_ids), raw_blocks(src, src_ids))
    untouched = [b for b in range(NUM_BLOCKS) if b not in {5, 9, 3, 0, 1, 2, 11, 7}]
    assert torch.equal(raw_blocks(dst, untouched), raw_blocks(before, untouched))


def test_a_sender_of_another_kv_format_is_refused_naming_both_and_writes_nothing(make_pair):
    """Equal pools (both float8) whose scales differ: every byte would fit, and every value
    would read back wrong. The receiver refuses at the transfer's first message."""
    theirs = dataclasses.replace(FP8_FORMAT, kv_scales="all 0.5")
    sender, receiver, _, dst = make_pair(FP8, formats=(theirs, FP8_FORMAT))
    before = dst.clone()
    receiver.expect("r", [3, 4])
    sender.begin("r", receiver.address, [0, 1], [3, 4])
    send_all(sender, "r")
    done, sent = poll_both_until_terminal(sender, receiver, {"r"})
    both = "kv_scales all 0.5 (prefill node, sender) vs all 1.0 (decode node, receiver)"
    assert done["r"].state is TransferState.FAILED and both in done["r"].error
    assert not done["r"].answered_by_sender  # the decode node answers the router itself
    assert torch.equal(dst.view(torch.uint8), before.view(torch.uint8))
    # Frames are all out before any answer (cuda_ipc's direct writer waits for its copies and
    # hears the refusal: tests/test_kv_transfer_cuda_ipc_gpu.py): the sender's caller frees its
    # blocks on DONE as on FAILED.
    assert sent["r"].state is TransferState.DONE


def test_a_receiver_with_a_format_refuses_a_sender_that_announces_none(make_pair):
    sender, receiver, _, _ = make_pair(formats=(None, FP8_FORMAT))
    receiver.expect("r", [3])
    sender.begin("r", receiver.address, [0], [3])
    send_all(sender, "r")
    (t,) = poll_until_terminal(receiver, {"r"}).values()
    assert t.state is TransferState.FAILED and "announced no KV format" in t.error
    assert FP8_FORMAT.describe() in t.error


def test_fp8_heads_land_bit_exact_from_a_frame_or_from_its_bytes():
    """A tensor-parallel decode node: rank 0 writes its heads from the received float8 frame
    and hands the frame to the other ranks as bytes (collectives may lack float8)."""
    pool = make_pool(FP8, seed=3)
    frame = pool[1][:, [0, 1]]
    halves = [torch.zeros_like(pool[..., :1, :]) for _ in range(2)]
    write_heads(halves[0], range(0, 1), 1, [4, 5], 0, frame)
    write_heads(halves[1], range(1, 2), 1, [4, 5], 0, frame.view(torch.uint8))
    for head, half in enumerate(halves):
        want = pool[1][:, [0, 1], :, head : head + 1]
        assert torch.equal(half[1][:, [4, 5]].view(torch.uint8), want.view(torch.uint8))


def test_send_layers_ships_a_range_and_refuses_a_layer_sent_twice(make_pair):
    sender, receiver, src, dst = make_pair()
    receiver.expect("r", [5, 9, 3])
    sender.begin("r", receiver.address, [0, 1, 2], [5, 9, 3])
    sender.send_layer("r", 1)
    with pytest.raises(ValueError, match="sent twice"):
        sender.send_layers("r", range(1, 2))
    sender.send_layers("r", range(2, NUM_LAYERS))
    sender.send_layers("r", range(0, 1))
    sender.complete("r", {})
    (t,) = poll_until_terminal(receiver, {"r"}).values()
    assert t.state is TransferState.DONE
    assert torch.equal(blocks(dst, [5, 9, 3]), blocks(src, [0, 1, 2]))


def test_zmq_receiver_bound_to_port_zero_exposes_the_real_port():
    with ZmqReceiver(make_pool(torch.float32, 0), TransferConfig(), "tcp://127.0.0.1:0") as r:
        assert r.address.startswith("tcp://127.0.0.1:") and not r.address.endswith(":0")


def test_sender_abort_fails_the_receiver_transfer_and_writes_nothing_after_it(make_pair):
    sender, receiver, src, dst = make_pair()
    before = dst.clone()
    receiver.expect("r", [3, 4])
    sender.begin("r", receiver.address, [0, 1], [3, 4])
    sender.send_layer("r", 0)
    sender.abort("r", "client disconnected")
    sender.send_layer("r", 1)  # after abort: a no-op, not an error
    sender.complete("r", {})

    (failed,) = poll_until_terminal(receiver, {"r"}).values()
    assert failed.state is TransferState.FAILED
    assert failed.error == "aborted by sender: client disconnected"
    assert failed.answered_by_sender
    assert torch.equal(dst[1:], before[1:])
    (local,) = poll_sender_until_terminal(sender, {"r"}).values()
    assert local.state is TransferState.FAILED and local.error == "client disconnected"
    sender.abort("r", "again")  # forgotten request: still a no-op


@zmq_and_loopback_only
def test_cancelled_transfer_drops_late_frames_and_keeps_working(make_pair):
    sender, receiver, src, dst = make_pair()
    before = dst.clone()
    receiver.expect("gone", [3, 4])
    receiver.cancel("gone")
    sender.begin("gone", receiver.address, [0, 1], [3, 4])
    send_all(sender, "gone")
    # Same connection, so once the next request is DONE every frame of "gone" was handled.
    receiver.expect("next", [8])
    sender.begin("next", receiver.address, [5], [8])
    send_all(sender, "next", {"n": 1})

    done = poll_until_terminal(receiver, {"next"})
    assert set(done) == {"next"} and done["next"].state is TransferState.DONE
    assert torch.equal(blocks(dst, [3, 4]), blocks(before, [3, 4]))
    assert torch.equal(blocks(dst, [8]), blocks(src, [5]))
    assert receiver.late_frames == NUM_LAYERS + 1  # every layer and the completion notice


@zmq_and_loopback_only
def test_late_frames_to_a_freed_reservation_never_touch_its_blocks_new_owner(make_pair):
    """The decode node freed r1's blocks (its transfer failed at the deadline) and reserved
    the same blocks for r2; r1's sender, slow but alive, still ships. Its frames are dropped
    and counted, and r2's KV is exactly what r2's sender wrote."""
    sender, receiver, src, dst = make_pair(deadline_s=0.3)
    receiver.expect("r1", [3, 4])
    (expired,) = poll_until_terminal(receiver, {"r1"}).values()
    assert expired.state is TransferState.FAILED and expired.error == "deadline exceeded"
    assert not expired.answered_by_sender
    receiver.expect("r2", [3, 4])  # the freed blocks, handed to the next request
    sender.begin("r2", receiver.address, [6, 7], [3, 4])
    sender.begin("r1", receiver.address, [0, 1], [3, 4])
    for layer in range(NUM_LAYERS):  # interleaved on one connection: r1's frames come late
        sender.send_layer("r1", layer)
        sender.send_layer("r2", layer)
    sender.complete("r1", {})
    sender.complete("r2", {})
    done = poll_until_terminal(receiver, {"r2"})
    assert done["r2"].state is TransferState.DONE
    assert torch.equal(blocks(dst, [3, 4]), blocks(src, [6, 7]))
    assert receiver.late_frames == NUM_LAYERS + 1


def test_a_transfer_reported_done_still_arrives_when_the_sender_closes_at_once(tmp_path):
    """zmq's DONE means "handed to the socket": a draining prefill node that closes its sender
    right after must not drop those frames. Here the receiver binds only after the close began,
    so every frame is still queued in the sender when it closes."""
    address = f"ipc://{tmp_path}/late-receiver"
    # cuda_ipc's frames mode closes the same way. A linger far beyond what the test needs:
    # the close returns as soon as the frames are out.
    config = TransferConfig(transport="zmq", close_linger_s=60.0)
    src, dst = make_pool(torch.float32, seed=1), make_pool(torch.float32, seed=2)
    sender = create_sender(config, src)
    sender.begin("r", address, [0, 1], [3, 4])
    send_all(sender, "r", {"kept": True})
    (sent,) = poll_sender_until_terminal(sender, {"r"}).values()
    assert sent.state is TransferState.DONE
    closing = threading.Thread(target=sender.close)
    closing.start()
    try:
        with create_receiver(config, dst, address) as receiver:
            receiver.expect("r", [3, 4])
            (t,) = poll_until_terminal(receiver, {"r"}).values()
            assert t.state is TransferState.DONE and t.metadata == {"kept": True}
            assert torch.equal(blocks(dst, [3, 4]), blocks(src, [0, 1]))
    finally:
        closing.join()


def test_a_sender_that_vanishes_mid_transfer_is_reclaimed_by_the_receiver_deadline(make_pair):
    sender, receiver, _, _ = make_pair(deadline_s=0.3)
    receiver.expect("r", [1, 2])
    sender.begin("r", receiver.address, [0, 1], [1, 2])
    sender.send_layer("r", 0)
    sender.close()  # the prefill process is gone: no more frames, no abort
    (t,) = poll_until_terminal(receiver, {"r"}).values()
    assert t.state is TransferState.FAILED and t.error == "deadline exceeded"


def test_a_receiver_that_vanishes_leaves_the_sender_nothing_to_hold(make_pair):
    sender, receiver, _, _ = make_pair(deadline_s=0.3, close_linger_s=0.1)
    receiver.expect("r", [1, 2])
    sender.begin("r", receiver.address, [0, 1], [1, 2])
    receiver.close()  # the decode process is gone
    send_all(sender, "r")
    # Terminal by its deadline at the latest (zmq: DONE once handed over, nothing to ack),
    # after which the caller frees the source blocks and the sender forgets the request.
    (t,) = poll_sender_until_terminal(sender, {"r"}).values()
    assert t.is_terminal
    assert sender.poll() == []


@zmq_and_loopback_only
def test_receiver_fails_a_transfer_that_never_arrives_after_its_deadline(make_pair):
    _, receiver, _, _ = make_pair(deadline_s=0.2)
    receiver.expect("never", [1, 2])
    (t,) = poll_until_terminal(receiver, {"never"}).values()
    assert t.state is TransferState.FAILED and t.error == "deadline exceeded"


def test_sender_deadline_fails_both_sides(make_pair):
    sender, receiver, _, _ = make_pair(deadline_s=0.2)
    sender.begin("slow", receiver.address, [0], [1])
    receiver.expect("slow", [1])
    sender.send_layer("slow", 0)  # and never the rest
    (local,) = poll_sender_until_terminal(sender, {"slow"}).values()
    assert local.state is TransferState.FAILED and local.error == "deadline exceeded"
    (remote,) = poll_until_terminal(receiver, {"slow"}).values()
    assert remote.state is TransferState.FAILED


def test_complete_with_missing_layers_raises(make_pair):
    sender, receiver, _, _ = make_pair()
    sender.begin("r", receiver.address, [0], [1])
    sender.send_layer("r", 0)
    with pytest.raises(ValueError, match=r"layers \[1, 2\] not sent"):
        sender.complete("r", {})
    with pytest.raises(ValueError, match="sent twice"):
        sender.send_layer("r", 0)
    with pytest.raises(ValueError, match="never begun"):
        sender.send_layer("unknown", 0)


def test_begin_rejects_mismatched_block_lists(make_pair):
    sender, receiver, _, _ = make_pair()
    with pytest.raises(ValueError, match="2 source blocks, 1 destination"):
        sender.begin("r", receiver.address, [0, 1], [2])


@pytest.mark.parametrize("fail_rate, expected", [(1.0, TransferState.FAILED), (0.0, None)])
def test_failure_injection_fails_every_transfer_on_both_sides_or_none(
    make_pair, fail_rate, expected
):
    sender, receiver, src, dst = make_pair(fail_rate=fail_rate)
    rids = {f"r{i}" for i in range(4)}
    for i, rid in enumerate(sorted(rids)):
        receiver.expect(rid, [i])
        sender.begin(rid, receiver.address, [i], [i])
        send_all(sender, rid)
    remote = poll_until_terminal(receiver, rids)
    local = poll_sender_until_terminal(sender, rids)
    want = expected or TransferState.DONE
    assert {t.state for t in [*remote.values(), *local.values()]} == {want}
    if fail_rate:
        assert {t.error for t in local.values()} == {"injected failure"}
        assert {t.error for t in remote.values()} == {"aborted by sender: injected failure"}
        assert not any(t.answered_by_sender for t in remote.values())  # its node must tell


def test_unknown_transport_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="cuda_ipc, loopback, nixl, zmq"):
        create_sender(TransferConfig(transport="pigeon"), make_pool(torch.float32, 0))
    with pytest.raises(ValueError, match="pigeon"):
        create_receiver(TransferConfig(transport="pigeon"), make_pool(torch.float32, 0), "x")
    assert TRANSPORTS["zmq"] == (ZmqSender, ZmqReceiver)
    assert TRANSPORTS["loopback"] == (LoopbackSender, LoopbackReceiver)


def test_unreachable_destination_fails_the_transfer_not_the_sender(make_pair, transport):
    sender, receiver, _, _ = make_pair()
    nowhere = "loopback://nobody" if transport == "loopback" else "not-an-endpoint"
    sender.begin("lost", nowhere, [0], [0])
    send_all(sender, "lost")  # no-ops once the transfer failed
    (t,) = sender.poll()
    assert t.state is TransferState.FAILED
    if isinstance(sender, CudaIpcSender):
        assert "cannot connect" in t.error and sender.route(nowhere) is None
    # The sender still works for a reachable receiver.
    receiver.expect("ok", [1])
    sender.begin("ok", receiver.address, [1], [1])
    send_all(sender, "ok")
    assert poll_until_terminal(receiver, {"ok"})["ok"].state is TransferState.DONE


def test_complete_rejects_metadata_the_receiver_could_not_decode(make_pair):
    sender, receiver, _, _ = make_pair()
    receiver.expect("r", [0])
    sender.begin("r", receiver.address, [0], [0])
    for layer in range(NUM_LAYERS):
        sender.send_layer("r", layer)
    with pytest.raises(ValueError, match="msgpack"):
        sender.complete("r", {"timing": {1: 0.5}})
    sender.complete("r", {"timing": {"prefill": 0.5}})  # the transfer is still usable
    assert poll_until_terminal(receiver, {"r"})["r"].metadata == {"timing": {"prefill": 0.5}}


def test_receiver_that_stops_reading_fails_transfers_instead_of_blocking_the_sender():
    ctx = zmq.Context()
    stalled = ctx.socket(zmq.PULL)  # bound, never read
    port = stalled.bind_to_random_port("tcp://127.0.0.1")
    failed: list[Transfer] = []
    with ZmqSender(make_pool(torch.float32, 0), TransferConfig(close_linger_s=0.1)) as sender:
        for i in range(50_000):  # far more than both queues and the socket buffers hold
            rid = f"r{i}"
            sender.begin(rid, f"tcp://127.0.0.1:{port}", [0], [0])
            send_all(sender, rid)
            failed = [t for t in sender.poll() if t.state is TransferState.FAILED]
            if failed:
                break
    stalled.close(linger=0)
    ctx.term()
    assert failed and "is full" in failed[0].error


def test_mismatched_pool_layout_fails_the_transfer(make_pair):
    sender, receiver, _, _ = make_pair(torch.float32, dst_dtype=torch.bfloat16)
    receiver.expect("r", [2])
    sender.begin("r", receiver.address, [1], [2])
    send_all(sender, "r")
    (t,) = poll_until_terminal(receiver, {"r"}).values()
    assert t.state is TransferState.FAILED and "dtype torch.float32" in t.error


def test_a_completion_payload_past_the_header_bound_arrives_with_its_metadata(make_pair):
    """A payload frame behind "complete" (EAGLE-3 rows) is not bounded by MAX_HEADER_BYTES."""
    sender, receiver, _, _ = make_pair()
    data = torch.arange(MAX_HEADER_BYTES // 2 + 7, dtype=torch.int16).view(torch.bfloat16)
    receiver.expect("r", [4])
    receiver.expect("plain", [5])
    sender.begin("r", receiver.address, [1], [4])
    sender.begin("plain", receiver.address, [2], [5])
    for layer in range(NUM_LAYERS):
        sender.send_layer("r", layer)
    with pytest.raises(ValueError, match="contiguous host tensor"):
        sender.complete("r", {}, data[::2])
    sender.complete("r", {"rows": 1}, data)
    send_all(sender, "plain", {"rows": 0})
    done, _ = poll_both_until_terminal(sender, receiver, {"r", "plain"})
    assert done["r"].state is TransferState.DONE and done["r"].metadata == {"rows": 1}
    assert bytes(done["r"].payload) == as_bytes(data).tobytes()
    assert done["plain"].payload is None


def completion(rid: str, payload_bytes: int) -> bytes:
    header = {"kind": "complete", "request_id": rid, "metadata": {}, "payload_bytes": payload_bytes}
    return msgpack.packb(header)


BAD_COMPLETIONS = {  # request -> (message, the values its error names)
    "short": ([completion("short", 10), bytes(9)], "payload is 9 bytes, its header says 10"),
    "missing": ([completion("missing", 10)], "payload_bytes=10 has 1 parts, not 2"),
    "unsized": ([completion("unsized", 0), bytes(4)], "payload_bytes=0 has 2 parts, not 1"),
    "negative": ([completion("negative", -1), bytes(1)], "payload of -1 bytes outside"),
}


@pytest.mark.parametrize("transport", ["zmq", "loopback"])
def test_malformed_completion_payloads_fail_their_transfer_naming_the_sizes(transport):
    """The receiver reports each FAILED (so the node frees its blocks) and keeps working."""
    config = TransferConfig(transport=transport)
    src, dst = make_pool(torch.float32, 1), make_pool(torch.float32, 2)
    ctx = zmq.Context()
    receiver = create_receiver(config, dst, bind_address(transport))
    with receiver:
        for i, rid in enumerate(BAD_COMPLETIONS):
            receiver.expect(rid, [i])
        if isinstance(receiver, LoopbackReceiver):
            for frames, _ in BAD_COMPLETIONS.values():
                receiver.deliver(frames[0], memoryview(frames[1]) if len(frames) > 1 else None)
        else:
            raw = ctx.socket(zmq.PUSH)
            raw.connect(receiver.address)
            for frames, _ in BAD_COMPLETIONS.values():
                raw.send_multipart(frames)
        failed = poll_until_terminal(receiver, set(BAD_COMPLETIONS))
        for rid, (_, error) in BAD_COMPLETIONS.items():
            assert failed[rid].state is TransferState.FAILED
            assert error in failed[rid].error, (rid, failed[rid].error)
        with create_sender(config, src) as sender:
            assert_a_good_transfer_still_lands(sender, receiver, src, dst, dst.clone())
        if not isinstance(receiver, LoopbackReceiver):
            raw.close(linger=0)
    ctx.term()


# -- hostile or broken frames on the ZMQ wire -------------------------------------------------


def layer_header(rid: str, layer: int, block_ids: list[int], **overrides) -> bytes:
    header = {
        "kind": "layer",
        "request_id": rid,
        "layer": layer,
        "block_ids": block_ids,
        "dtype": "torch.float32",
        "shape": [2, len(block_ids), BLOCK_SIZE, HEADS, HEAD_DIM],
        **overrides,
    }
    return msgpack.packb(header)


def payload(n_blocks: int, extra: int = 0) -> bytes:
    return bytes(2 * n_blocks * BLOCK_SIZE * HEADS * HEAD_DIM * 4 + extra)


def bad_frames() -> dict[str, tuple[list[int], list[bytes], str]]:
    """request -> (its reservation, a message that must fail it, the error it gets), for a
    receiver of the frames wire; the reservations take blocks 0-7."""
    early_complete = {"kind": "complete", "request_id": "early-complete", "metadata": {}}
    return {
        "garbage-header": (
            [0],
            [msgpack.packb({"request_id": "garbage-header", "kind": 3})],
            "unknown header kind",
        ),
        "wrong-ids": ([1, 2], [layer_header("wrong-ids", 0, [1, 9]), payload(2)], "block ids"),
        "wrong-size": ([3], [layer_header("wrong-size", 0, [3]), payload(1, 4)], "516 bytes"),
        "wrong-dtype": (
            [4],
            [layer_header("wrong-dtype", 0, [4], dtype="int8"), payload(1)],
            "dtype",
        ),
        "no-payload": ([5], [layer_header("no-payload", 0, [5])], "1 parts, not 2"),
        "bad-layer": ([6], [layer_header("bad-layer", NUM_LAYERS, [6]), payload(1)], "outside"),
        "early-complete": ([7], [msgpack.packb(early_complete)], "incomplete"),
    }


def assert_a_good_transfer_still_lands(
    sender: KVSender,
    receiver: KVReceiver,
    src: torch.Tensor,
    dst: torch.Tensor,
    before: torch.Tensor,
) -> None:
    """After the hostile messages: block 11 gets exactly its KV, no other block changed, and the
    bystander (expected, never sent) is still pending."""
    receiver.expect("good", [11])
    sender.begin("good", receiver.address, [2], [11])
    send_all(sender, "good", {"ok": True})
    done = poll_until_terminal(receiver, {"good"})
    assert set(done) == {"good"}, "the bystander must stay pending"
    assert done["good"].state is TransferState.DONE and done["good"].metadata == {"ok": True}
    assert torch.equal(blocks(dst, [11]), blocks(src, [2]))
    untouched = [b for b in range(NUM_BLOCKS) if b != 11]
    assert torch.equal(blocks(dst, untouched), blocks(before, untouched))


def test_malformed_frames_fail_only_their_transfer_and_the_receiver_keeps_working():
    config = TransferConfig()
    src, dst = make_pool(torch.float32, 1), make_pool(torch.float32, 2)
    before = dst.clone()
    ctx = zmq.Context()
    with ZmqReceiver(dst, config, "tcp://127.0.0.1:0") as receiver:
        raw = ctx.socket(zmq.PUSH)
        raw.connect(receiver.address)
        bad = {
            **bad_frames(),
            "wrong-shape": (
                [8],
                [layer_header("wrong-shape", 0, [8], shape=[2, 1]), payload(1)],
                "shape",
            ),
        }
        for rid, (block_ids, _, _) in bad.items():
            receiver.expect(rid, block_ids)
        receiver.expect("bystander", [10])
        for frames in [
            [b"\xc1 not msgpack at all"],
            [msgpack.packb(["a", "list"])],
            [layer_header("stranger", 0, [11]), payload(1)],  # nobody expects it: dropped
            *(frames for _, frames, _ in bad.values()),
        ]:
            raw.send_multipart(frames)
        failed = poll_until_terminal(receiver, set(bad))
        for rid, (_, _, error) in bad.items():
            assert failed[rid].state is TransferState.FAILED
            assert error in failed[rid].error, (rid, failed[rid].error)

        with ZmqSender(src, config) as sender:
            assert_a_good_transfer_still_lands(sender, receiver, src, dst, before)
        raw.close(linger=0)
    ctx.term()


# -- CUDA pools (run where a GPU is present) --------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@zmq_and_loopback_only  # cuda_ipc's direct path: tests/test_kv_transfer_cuda_ipc_gpu.py
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_cuda_pools_transfer_exactly(transport, dtype):
    config = TransferConfig(transport=transport)
    src = make_pool(dtype, 1).cuda()
    dst = make_pool(dtype, 2).cuda()
    before = dst.clone()
    with create_receiver(config, dst, bind_address(transport)) as receiver:
        with create_sender(config, src) as sender:
            for rid, (src_ids, dst_ids) in MAPPINGS.items():
                receiver.expect(rid, dst_ids)
                sender.begin(rid, receiver.address, src_ids, dst_ids)
                for layer in reversed(range(NUM_LAYERS)):
                    sender.send_layer(rid, layer)
                sender.complete(rid, {"rid": rid})
            done, sent = poll_both_until_terminal(sender, receiver, set(MAPPINGS))
    assert {t.state for t in [*done.values(), *sent.values()]} == {TransferState.DONE}
    for src_ids, dst_ids in MAPPINGS.values():
        assert torch.equal(raw_blocks(dst, dst_ids), raw_blocks(src, src_ids))
    untouched = [b for b in range(NUM_BLOCKS) if b not in {5, 9, 3, 0, 1, 2, 11, 7}]
    assert torch.equal(raw_blocks(dst, untouched), raw_blocks(before, untouched))


@cuda
@zmq_and_loopback_only
def test_cuda_send_layer_ships_what_the_current_stream_wrote_last(transport):
    """send_layer may be called while the GPU still computes: the shipped KV must be the values
    queued on the current stream before the call, not whatever the pool held at that moment."""
    config = TransferConfig(transport=transport)
    src = torch.zeros(NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, device="cuda")
    dst = torch.zeros_like(src)
    with create_receiver(config, dst, bind_address(transport)) as receiver:
        with create_sender(config, src) as sender:
            receiver.expect("r", [4])
            sender.begin("r", receiver.address, [3], [4])
            busy = torch.randn(4096, 4096, device="cuda")
            for layer in range(NUM_LAYERS):
                for _ in range(20):  # keep the current stream busy before the write
                    busy = torch.tanh(busy @ busy)
                src[layer, :, 3].fill_(layer + 1)  # queued behind the matmuls
                sender.send_layer("r", layer)
            sender.complete("r", {})
            (t,) = poll_both_until_terminal(sender, receiver, {"r"})[0].values()
    assert t.state is TransferState.DONE
    for layer in range(NUM_LAYERS):
        assert torch.all(dst[layer, :, 4] == layer + 1)
