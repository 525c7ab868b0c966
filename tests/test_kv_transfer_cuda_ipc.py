"""The cuda_ipc transport on CPU: handshake codec, export/open refusals, the frames fallback
(CPU pools cannot be exported, so every transfer takes it), the receiver's cancel contract,
hostile messages on both sockets. The contract it shares with zmq and loopback runs in
tests/test_kv_transfer.py (a case of its `transport` fixture); direct CUDA IPC writes:
tests/test_kv_transfer_cuda_ipc_gpu.py.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import msgpack
import pytest
import torch
import zmq
from test_kv_transfer import (  # tests/ is on sys.path under pytest
    MAPPINGS,
    MAX_WAIT_S,
    NUM_LAYERS,
    SHAPE,
    assert_a_good_transfer_still_lands,
    bad_frames,
    blocks,
    handshake,
    layer_header,
    make_pool,
    payload,
    poll_sender_until_terminal,
    poll_until_terminal,
    send_all,
)

from kv_transfer import TRANSPORTS, TransferConfig, TransferState, create_receiver
from kv_transfer import ipc_sender as ipc_sender_module
from kv_transfer.cuda_ipc import CANCELLED, CudaIpcReceiver, CudaIpcSender, Route
from kv_transfer.frames import AbortHeader, CompleteHeader, FrameError, LayerHeader
from kv_transfer.ipc_handles import (
    Cancel,
    Hello,
    IpcUnavailable,
    NoExport,
    PoolExport,
    Reset,
    Start,
    decode_message,
    encode_message,
    export_pool,
    host_id,
    open_pool,
)
from kv_transfer.ipc_sender import CANCELLED_BY_RECEIVER

ADDRESS = "tcp://127.0.0.1:0"


@pytest.fixture
def make_pair():
    """(sender, receiver, src_pool, dst_pool) on CPU, handshaken; closed after the test."""
    opened: list = []

    def make(dtype=torch.float32, grace_s=5.0, connect=True, **config_kwargs):
        config = TransferConfig(transport="cuda_ipc", **config_kwargs)
        src, dst = make_pool(dtype, seed=1), make_pool(dtype, seed=2)
        receiver = CudaIpcReceiver(dst, config, ADDRESS, cancel_grace_s=grace_s)
        sender = CudaIpcSender(src, config)
        opened.extend([sender, receiver])
        if connect:
            handshake(sender, receiver)
        return sender, receiver, src, dst

    yield make
    for endpoint in opened:
        endpoint.close()


# -- wire messages --------------------------------------------------------------------------------


def a_pool_export(**overrides: Any) -> PoolExport:
    fields = dict(
        session="s1",
        host_id=host_id(),
        pid=4242,
        device_uuid="GPU-0000",
        dtype="torch.bfloat16",
        shape=list(SHAPE),
        stride=[1] * 6,
        storage_offset=0,
        storage_device=0,
        storage_handle=b"\x00\x01handle",
        storage_size_bytes=1 << 20,
        storage_offset_bytes=512,
        ref_counter_handle=b"/torch_123_456",
        ref_counter_offset=3,
        event_handle=b"\xff" * 64,
        event_sync_required=True,
    )
    return PoolExport(**{**fields, **overrides})


def encode_fields(message: Any) -> dict:
    return msgpack.unpackb(encode_message(message), raw=False)


@pytest.mark.parametrize(
    "message",
    [
        Hello(host_id(), 123),
        a_pool_export(),
        NoExport("s1", "host/boot", "the receiver's pool is on cpu, not a GPU"),
        Start("r", "s1", direct=True),
        Cancel("r"),
        Reset("the receiver restarted; connect again"),
    ],
)
def test_ipc_messages_round_trip_with_bytes_fields_intact(message):
    assert decode_message(encode_message(message)) == message


def test_the_ipc_codec_also_decodes_the_frames_headers():
    from kv_transfer.frames import encode_header

    for header in [
        LayerHeader("r", 1, [4], "torch.bfloat16", [2, 1, 4, 2, 8]),
        CompleteHeader("r", {"first_token": 3}),
        AbortHeader("r", "bye"),
    ]:
        assert decode_message(encode_header(header)) == header


@pytest.mark.parametrize(
    "raw, request_id",
    [
        ({"kind": "hello", "host_id": "h", "pid": "1"}, None),
        ({"kind": "hello", "host_id": "h"}, None),
        ({"kind": "start", "request_id": "r", "session": "s", "direct": 1}, "r"),
        ({"kind": "start", "request_id": "r", "session": "s", "direct": True, "x": 0}, "r"),
        ({"kind": "cancel", "request_id": 7}, None),
        ({"kind": "cancel", "request_id": "r", "extra": "field"}, "r"),
        ({"kind": "export", "session": "s"}, None),
        ({**encode_fields(a_pool_export()), "storage_handle": "a str, not bytes"}, None),
        ({**encode_fields(a_pool_export()), "event_sync_required": None}, None),
        ({"kind": "teleport", "request_id": "r"}, "r"),
    ],
)
def test_malformed_ipc_messages_raise_frame_error_naming_the_request_when_known(raw, request_id):
    with pytest.raises(FrameError) as info:
        decode_message(msgpack.packb(raw, use_bin_type=True))
    assert info.value.request_id == request_id


def test_registry_lists_cuda_ipc():
    assert TRANSPORTS["cuda_ipc"] == (CudaIpcSender, CudaIpcReceiver)
    with create_receiver(
        TransferConfig(transport="cuda_ipc"), make_pool(torch.float32, 0), ADDRESS
    ) as receiver:
        assert isinstance(receiver, CudaIpcReceiver)
        assert receiver.address.startswith("tcp://127.0.0.1:")
        assert not receiver.address.endswith(":0")


# -- export / open refusals (the reasons a sender falls back) -------------------------------------


def test_a_cpu_pool_cannot_be_exported_or_open_a_remote_one():
    with pytest.raises(IpcUnavailable, match="pool is on cpu"):
        export_pool(make_pool(torch.float32, 0), "s")
    with pytest.raises(IpcUnavailable, match="another host"):
        open_pool(a_pool_export(host_id="elsewhere/boot"), make_pool(torch.bfloat16, 0))
    with pytest.raises(IpcUnavailable, match="local pool is on cpu"):
        open_pool(a_pool_export(), make_pool(torch.bfloat16, 0))


def test_cpu_pools_fall_back_to_frames_with_one_warning_per_receiver(make_pair, caplog):
    caplog.set_level(logging.WARNING, logger="kv_transfer.ipc_sender")
    sender, receiver, src, dst = make_pair()
    route = sender.route(receiver.address)
    assert route == Route(
        direct=False, reason="the receiver's pool is on cpu, not a GPU", device=""
    )
    for rid, (src_ids, dst_ids) in MAPPINGS.items():
        receiver.expect(rid, dst_ids)
        sender.begin(rid, receiver.address, src_ids, dst_ids)
        send_all(sender, rid)
    poll_until_terminal(receiver, set(MAPPINGS))
    warnings = [r.getMessage() for r in caplog.records if receiver.address in r.getMessage()]
    assert len(warnings) == 1 and "not CUDA IPC" in warnings[0] and "on cpu" in warnings[0]


# -- frames mode where it differs from zmq ----------------------------------------------------------


def test_send_layers_checks_every_layer_before_sending_any(make_pair):
    sender, receiver, src, dst = make_pair()
    receiver.expect("r", [5, 9, 3])
    sender.begin("r", receiver.address, [0, 1, 2], [5, 9, 3])
    sender.send_layer("r", 1)
    with pytest.raises(ValueError, match="sent twice"):
        sender.send_layers("r", range(NUM_LAYERS))
    sender.send_layers("r", range(0, 1))
    sender.send_layers("r", range(2, NUM_LAYERS))
    sender.complete("r", {})
    (t,) = poll_until_terminal(receiver, {"r"}).values()
    assert t.state is TransferState.DONE
    assert torch.equal(blocks(dst, [5, 9, 3]), blocks(src, [0, 1, 2]))


def test_receiver_deadline_waits_the_cancel_grace_when_no_sender_ever_spoke(make_pair):
    _, receiver, _, _ = make_pair(deadline_s=0.2, grace_s=0.3)
    t0 = time.monotonic()
    receiver.expect("never", [1, 2])
    (t,) = poll_until_terminal(receiver, {"never"}).values()
    assert t.state is TransferState.FAILED and t.error == "deadline exceeded"
    assert time.monotonic() - t0 >= 0.5  # deadline, then the grace a possible writer gets


# -- the cancel contract ------------------------------------------------------------------------


def test_cancel_of_a_request_the_receiver_does_not_know_frees_the_blocks_at_once(make_pair):
    _, receiver, _, _ = make_pair()
    assert receiver.cancel("stranger") is True


def test_cancel_before_any_sender_spoke_holds_the_blocks_until_the_grace_period_ends(make_pair):
    _, receiver, _, _ = make_pair(grace_s=0.4)
    receiver.expect("r", [3])
    t0 = time.monotonic()
    assert receiver.cancel("r") is False  # a sender may begin writing any moment
    assert receiver.cancel("r") is False  # asking again changes nothing
    with pytest.raises(ValueError, match="already active"):
        receiver.expect("r", [3])  # still held
    assert receiver.poll(timeout_s=0.1) == []
    (t,) = poll_until_terminal(receiver, {"r"}).values()
    assert t.state is TransferState.FAILED and t.error == CANCELLED
    assert time.monotonic() - t0 >= 0.4


def test_cancel_after_a_frames_mode_start_frees_the_blocks_at_once_and_stops_the_sender(
    make_pair,
):
    sender, receiver, src, dst = make_pair(grace_s=30.0)
    before = dst.clone()
    gone = receiver.expect("gone", [3, 4])
    sender.begin("gone", receiver.address, [0, 1], [3, 4])
    until = time.monotonic() + MAX_WAIT_S
    while gone.state is TransferState.PENDING:  # the "start" notice names the sender and mode
        assert receiver.poll(timeout_s=0.02) == [] and time.monotonic() < until
    assert receiver.cancel("gone") is True  # frames only reach the pool through the receiver
    (local,) = poll_sender_until_terminal(sender, {"gone"}).values()
    assert local.state is TransferState.FAILED and local.error == CANCELLED_BY_RECEIVER

    receiver.expect("next", [8])
    sender.begin("next", receiver.address, [5], [8])
    send_all(sender, "next", {"n": 1})
    done = poll_until_terminal(receiver, {"next"})
    assert set(done) == {"next"}, "a cancel that returned True is never reported"
    assert torch.equal(blocks(dst, [3, 4]), blocks(before, [3, 4]))
    assert torch.equal(blocks(dst, [8]), blocks(src, [5]))


def test_a_cancel_the_sender_hears_before_begin_fails_that_begin_and_ends_the_hold_early(
    make_pair,
):
    sender, receiver, _, dst = make_pair(grace_s=30.0)
    before = dst.clone()
    receiver.expect("x", [2])
    t0 = time.monotonic()
    assert receiver.cancel("x") is False  # broadcast to every connected sender
    time.sleep(0.2)
    sender.poll()  # reads the cancel: remembers it, since it has not begun "x"
    t = sender.begin("x", receiver.address, [0], [2])
    assert t.state is TransferState.FAILED and t.error == CANCELLED_BY_RECEIVER
    (remote,) = poll_until_terminal(receiver, {"x"}).values()
    assert remote.state is TransferState.FAILED and remote.error == CANCELLED
    assert time.monotonic() - t0 < 10, "ended by the sender's abort, not the 30 s grace"
    assert torch.equal(dst, before)


def test_a_decline_ends_a_cancelled_hold_at_once(make_pair):
    """The prefill node's request ended before its transfer began (its first token finished
    it): the decode node cancelled, and the sender's decline frees the blocks, with no wait
    for a grace period (a year here)."""
    sender, receiver, _, dst = make_pair(grace_s=365 * 86400.0)
    before = dst.clone()
    receiver.expect("short", [2, 3])
    assert receiver.cancel("short") is False  # no writer seen yet: held
    sender.decline("short", receiver.address, "finished at the first token")
    (remote,) = poll_until_terminal(receiver, {"short"}).values()
    assert remote.state is TransferState.FAILED and remote.error == CANCELLED
    assert torch.equal(dst, before)
    assert sender.poll() == [], "a decline begins nothing on the sender"


def test_a_decline_before_the_cancel_fails_the_transfer_as_aborted_by_its_sender(make_pair):
    """The decline overtook the decode node's own abort: the transfer ends as a sender abort,
    which the decode node frees without telling the router (the prefill node did)."""
    sender, receiver, _, _ = make_pair(connect=False)  # a sender that never shook hands
    receiver.expect("short", [2])
    sender.decline("short", receiver.address, "finished at the first token")
    (remote,) = poll_until_terminal(receiver, {"short"}).values()
    assert remote.state is TransferState.FAILED and remote.answered_by_sender
    assert remote.error == "aborted by sender: finished at the first token"


def test_a_decline_of_a_begun_transfer_changes_nothing(make_pair):
    sender, receiver, src, dst = make_pair()
    receiver.expect("begun", [8])
    sender.begin("begun", receiver.address, [5], [8])
    sender.decline("begun", receiver.address, "ignored: abort() ends a begun transfer")
    send_all(sender, "begun")
    (remote,) = poll_until_terminal(receiver, {"begun"}).values()
    assert remote.state is TransferState.DONE
    assert torch.equal(blocks(dst, [8]), blocks(src, [5]))


# -- hostile or broken messages ------------------------------------------------------------------


def test_malformed_messages_fail_only_their_transfer_and_the_receiver_keeps_working(make_pair):
    sender, receiver, src, dst = make_pair(grace_s=0.3)
    before = dst.clone()
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(receiver.address)
    bad = {
        **bad_frames(),
        "extra-part": ([8], [encode_message(Cancel("extra-part")), b"?"], "2 parts, not 1"),
    }
    for rid, (block_ids, _, _) in bad.items():
        receiver.expect(rid, block_ids)
    receiver.expect("bystander", [10])
    receiver.expect("unannounced", [9])  # no "start" first: failed only after the grace
    messages = [
        [b"\xc1 not msgpack at all"],
        [msgpack.packb(["a", "list"])],
        [encode_message(Hello("h", 1)), b"extra part"],
        [encode_message(a_pool_export())],  # receiver-bound only in the other direction
        [encode_message(Reset("x"))],
        [encode_message(Start("stranger", "", direct=False))],  # nobody expects it
        [layer_header("stranger", 0, [11]), payload(1)],
        *([encode_message(Start(rid, "", direct=False))] for rid in bad),
        *(frames for _, frames, _ in bad.values()),
        [msgpack.packb({"kind": "layer", "request_id": "unannounced", "layer": "0"})],
    ]
    for frames in messages:
        raw.send_multipart(frames)
    t0 = time.monotonic()
    failed = poll_until_terminal(receiver, {*bad, "unannounced"})
    for rid, (_, _, error) in bad.items():
        assert failed[rid].state is TransferState.FAILED
        assert error in failed[rid].error, (rid, failed[rid].error)
    assert "malformed frame" in failed["unannounced"].error
    assert time.monotonic() - t0 >= 0.3

    assert_a_good_transfer_still_lands(sender, receiver, src, dst, before)
    raw.close(linger=0)
    ctx.term()


def test_a_direct_start_through_a_stale_export_fails_and_resets_the_sender(make_pair):
    _, receiver, _, _ = make_pair()
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(receiver.address)
    raw.send(encode_message(Hello(host_id(), 1)))
    reply = decode_message(recv_within(raw, receiver))
    assert isinstance(reply, NoExport) and "cpu" in reply.reason
    receiver.expect("r", [1])
    raw.send(encode_message(Start("r", "an older session", direct=True)))
    (t,) = poll_until_terminal(receiver, {"r"}).values()
    assert t.state is TransferState.FAILED and "stale pool export" in t.error
    assert isinstance(decode_message(recv_within(raw, receiver)), Reset)
    raw.close(linger=0)
    ctx.term()


def recv_within(sock: zmq.Socket, receiver: CudaIpcReceiver) -> bytes:
    until = time.monotonic() + MAX_WAIT_S
    while not sock.poll(10):
        receiver.poll()
        assert time.monotonic() < until, "no reply"
    return sock.recv()


def test_the_sender_survives_garbage_obeys_cancel_and_handshakes_again_after_reset(monkeypatch):
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)  # plays the receiver by hand
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"

    def recv() -> tuple[bytes, Any]:
        assert fake.poll(int(MAX_WAIT_S * 1000)), "the sender sent nothing"
        identity, frame, *_ = fake.recv_multipart()
        return identity, decode_message(frame)

    with CudaIpcSender(make_pool(torch.float32, 0), TransferConfig("cuda_ipc")) as sender:
        routes: list[Route | None] = []
        connecting = threading.Thread(target=lambda: routes.append(sender.connect(address)))
        connecting.start()
        identity, hello = recv()
        assert hello == Hello(host_id(), hello.pid)
        for garbage in [b"\xc1", msgpack.packb([1]), msgpack.packb({"kind": "cancel"})]:
            fake.send_multipart([identity, garbage])
        fake.send_multipart([identity, encode_message(NoExport("s", "h", "no GPU here"))])
        connecting.join()
        assert routes == [Route(direct=False, reason="no GPU here", device="")]

        sender.begin("r", address, [0], [0])
        assert recv()[1] == Start("r", "", direct=False)
        fake.send_multipart([identity, b"\xc1 more garbage"])
        fake.send_multipart([identity, encode_message(Cancel("r"))])
        (t,) = poll_sender_until_terminal(sender, {"r"}).values()
        assert t.state is TransferState.FAILED and t.error == CANCELLED_BY_RECEIVER
        assert recv()[1] == AbortHeader("r", CANCELLED_BY_RECEIVER)

        fake.send_multipart([identity, encode_message(Reset("restarted"))])
        until = time.monotonic() + MAX_WAIT_S
        while sender.route(address) is not None:  # forgotten once the reset is read
            assert sender.poll() == [] and time.monotonic() < until
        monkeypatch.setattr(ipc_sender_module, "HANDSHAKE_TIMEOUT_S", 0.2)
        sender.begin("r2", address, [0], [0])  # handshakes again; nobody answers this time
        assert isinstance(recv()[1], Hello)
        route = sender.route(address)
        assert route is not None and not route.direct and "no answer" in route.reason
    fake.close(linger=0)
    ctx.term()
