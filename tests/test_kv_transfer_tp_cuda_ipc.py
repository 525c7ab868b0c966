"""cuda_ipc between tensor-parallel sizes on CPU, no model. Each shipping prefill rank is a
sender of its own: in frames mode (CPU pools) its frames carry its heads; in direct mode its
"start" names its heads and its "complete" vouches for them (here spoken by hand on a DEALER
socket: the receiver never sees a direct write, only these messages). The receiver is DONE only
once every rank's heads of every layer are in, and it frees blocks a rank may still be writing
only once every rank stopped. Where the heads go (`head_copies`) and the head-slice copy kernel
run in Triton's interpreter. Real node processes: tests/test_tp_e2e.py; direct writes on two
GPUs: tests/test_tp_cuda_ipc_gpu.py.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before any kernel is decorated (common.model.kernels)
    os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import msgpack  # noqa: E402
import pytest  # noqa: E402
import zmq  # noqa: E402
from test_kv_transfer import handshake, poll_until_terminal  # noqa: E402
from test_kv_transfer_cuda_ipc import ADDRESS, a_pool_export, recv_within  # noqa: E402
from test_kv_transfer_tp import DST, KV_HEADS, LAYERS, SRC, layout, pool, rank_pools  # noqa: E402

from common.engine.tp_link import StepDriver  # noqa: E402
from common.model.distributed import TPGroup  # noqa: E402
from common.protocol.wire_auth import SIGNER  # noqa: E402
from kv_transfer import TransferConfig, TransferState  # noqa: E402
from kv_transfer.cuda_ipc import CANCELLED, CudaIpcReceiver, CudaIpcSender  # noqa: E402
from kv_transfer.frames import AbortHeader, CompleteHeader, FrameError, encode_header  # noqa: E402
from kv_transfer.ipc_handles import (  # noqa: E402
    Cancel,
    Hello,
    IpcUnavailable,
    NoExport,
    PoolExport,
    RankExports,
    Start,
    decode_message,
    encode_message,
    export_pool,
    forget_export,
    host_id,
)
from kv_transfer.ipc_writer import head_copies  # noqa: E402
from kv_transfer.tp import (  # noqa: E402
    PrefillRank,
    TPPoolWriter,
    check_transport,
    rank_transfer,
    shipping_ranks,
)

IPC = TransferConfig(transport="cuda_ipc")


@pytest.fixture
def opened():
    """Closes every endpoint a test appends, and the context of its raw ranks."""
    endpoints: list[Any] = []
    ctx = zmq.Context()
    yield endpoints, ctx
    for endpoint in endpoints:
        endpoint.close()
    ctx.term()


def receiver_of(dst: torch.Tensor, endpoints: list, grace_s: float = 30.0) -> CudaIpcReceiver:
    receiver = CudaIpcReceiver(dst, IPC, ADDRESS, cancel_grace_s=grace_s)
    endpoints.append(receiver)
    return receiver


def rank_senders(full: torch.Tensor, tp: int, receiver, endpoints: list) -> list[CudaIpcSender]:
    """The cuda_ipc senders of a prefill node of `tp` ranks over the rank pools of `full`,
    handshaken (CPU pools: frames mode)."""
    pools, lay = rank_pools(full, tp), layout(tp)
    senders = [CudaIpcSender(pools[r], rank_transfer(IPC, lay, r)) for r in shipping_ranks(lay)]
    for sender in senders:
        endpoints.append(sender)
        assert not handshake(sender, receiver).direct
    return senders


class RawRank:
    """A prefill rank speaking the cuda_ipc wire by hand on its own DEALER connection."""

    def __init__(self, ctx: zmq.Context, receiver: CudaIpcReceiver) -> None:
        self.receiver = receiver
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(receiver.address)
        self.send(Hello(host_id(), os.getpid()))
        self.reply = self.next()
        self.session = self.reply.session  # a CPU pool: NoExport, whose session is what matters

    def send(self, message: Any) -> None:
        encode = encode_header if isinstance(message, (CompleteHeader, AbortHeader)) else None
        self.sock.send((encode or encode_message)(message))

    def start(self, rid: str, heads: list[int], senders: int = 2) -> None:
        self.send(Start(rid, self.session, True, None, heads, senders))

    def next(self) -> Any:
        """The receiver's next message to this rank (polling the receiver meanwhile)."""
        return decode_message(recv_within(self.sock, self.receiver))

    def close(self) -> None:
        self.sock.close()


def raw_ranks(ctx: zmq.Context, receiver: CudaIpcReceiver, n: int, endpoints: list) -> list:
    ranks = [RawRank(ctx, receiver) for _ in range(n)]
    endpoints.extend(ranks)
    return ranks


def quiet_for(receiver: CudaIpcReceiver, seconds: float) -> list:
    """What the receiver reports over `seconds` (a hold must report nothing)."""
    out, until = [], time.monotonic() + seconds
    while time.monotonic() < until:
        out += receiver.poll(timeout_s=0.02)
    return out


# -- frames mode: every sending rank's frames carry its heads ----------------------------------


def test_two_frames_mode_ranks_fill_one_decode_pool_and_it_is_done_only_after_both(opened):
    endpoints, _ = opened
    full, dst = pool(KV_HEADS, seed=0), pool(KV_HEADS)
    receiver = receiver_of(dst, endpoints)
    first, second = rank_senders(full, 2, receiver, endpoints)
    receiver.expect("r", DST)
    first.begin("r", receiver.address, SRC, DST)
    first.send_layers("r", range(LAYERS))
    first.complete("r", {"first_token": 7})
    assert quiet_for(receiver, 0.3) == []  # head 1 of every layer is still missing
    second.begin("r", receiver.address, SRC, DST)
    second.send_layers("r", range(LAYERS))
    second.complete("r", {})
    (done,) = poll_until_terminal(receiver, {"r"}).values()
    assert done.state is TransferState.DONE and done.metadata == {"first_token": 7}
    assert torch.equal(dst[:, :, DST], full[:, :, SRC])


def test_a_declined_request_is_freed_once_every_sending_rank_declined(opened):
    """The prefill node's request ended before its transfer began: rank 0 declines and
    mirrors it (`TPSender.decline`) to its ranks (`PrefillRank`), each on its own connection."""
    endpoints, _ = opened
    receiver = receiver_of(pool(KV_HEADS), endpoints)
    first, second = rank_senders(pool(KV_HEADS, seed=1), 2, receiver, endpoints)
    receiver.expect("short", DST)
    assert receiver.cancel("short") is False  # nobody spoke yet: any rank may begin
    first.decline("short", receiver.address, "finished at the first token")
    assert quiet_for(receiver, 0.3) == []  # the other rank has not promised anything yet
    decline = {"op": "decline", "rid": "short", "dest": receiver.address, "reason": "done"}
    PrefillRank(second, LAYERS).command(decline, None)
    (t,) = poll_until_terminal(receiver, {"short"}).values()
    assert t.state is TransferState.FAILED and t.error == CANCELLED


# -- direct mode: each rank vouches for the heads its "start" named --------------------------------


def test_direct_ranks_each_vouch_for_their_heads_and_it_is_done_after_the_last(opened):
    endpoints, ctx = opened
    receiver = receiver_of(pool(KV_HEADS), endpoints)
    receiver.expect("r", DST)
    a, b = raw_ranks(ctx, receiver, 2, endpoints)
    a.start("r", [0, 1])
    b.start("r", [1, 2])
    a.send(CompleteHeader("r", {"first_token": 3}, senders=2))
    assert quiet_for(receiver, 0.3) == []
    b.send(CompleteHeader("r", {}, senders=2))
    (t,) = poll_until_terminal(receiver, {"r"}).values()
    assert t.state is TransferState.DONE and t.metadata == {"first_token": 3}


def test_two_direct_ranks_vouching_for_one_head_fail_the_transfer(opened):
    endpoints, ctx = opened
    receiver = receiver_of(pool(KV_HEADS), endpoints)
    receiver.expect("r", DST)
    a, b = raw_ranks(ctx, receiver, 2, endpoints)
    a.start("r", [0, 2])
    b.start("r", [1, 2])
    for rank in (a, b):
        rank.send(CompleteHeader("r", {}, senders=2))
    (t,) = poll_until_terminal(receiver, {"r"}).values()
    assert t.state is TransferState.FAILED and "arrived twice" in t.error


def test_one_rank_aborting_holds_the_blocks_until_the_other_stopped_writing(opened):
    """Rank 0's node ended the request; rank 1 still writes its heads: the decode node must
    not reuse the blocks before rank 1 answered the receiver's cancel."""
    endpoints, ctx = opened
    receiver = receiver_of(pool(KV_HEADS), endpoints)
    receiver.expect("r", DST)
    a, b = raw_ranks(ctx, receiver, 2, endpoints)
    a.start("r", [0, 1])
    b.start("r", [1, 2])
    a.send(AbortHeader("r", "client gone", answered=True, senders=2))
    assert b.next() == Cancel("r")
    assert quiet_for(receiver, 0.3) == []
    b.send(AbortHeader("r", "cancelled by the receiver", senders=2))
    (t,) = poll_until_terminal(receiver, {"r"}).values()
    assert t.state is TransferState.FAILED and t.answered_by_sender
    assert t.error == "aborted by sender: client gone"


def test_a_cancel_waits_for_every_rank_even_one_not_heard_from_yet(opened):
    endpoints, ctx = opened
    receiver = receiver_of(pool(KV_HEADS), endpoints)
    receiver.expect("r", DST)
    a, b = raw_ranks(ctx, receiver, 2, endpoints)
    a.start("r", [0, 1])
    assert quiet_for(receiver, 0.1) == []  # reads the start
    assert receiver.cancel("r") is False
    assert a.next() == Cancel("r") and b.next() == Cancel("r")  # b is not known to write "r"
    a.send(AbortHeader("r", "cancelled by the receiver", senders=2))
    assert quiet_for(receiver, 0.3) == []  # b might begin any moment
    b.send(AbortHeader("r", "ended before its transfer began", answered=True, senders=2))
    (t,) = poll_until_terminal(receiver, {"r"}).values()
    assert t.state is TransferState.FAILED and t.error == CANCELLED


def test_a_direct_start_naming_heads_the_model_lacks_is_refused_and_told_why(opened):
    endpoints, ctx = opened
    receiver = receiver_of(pool(KV_HEADS), endpoints)
    receiver.expect("r", DST)
    (a,) = raw_ranks(ctx, receiver, 1, endpoints)
    a.start("r", [1, 3], senders=1)
    cancel = a.next()
    assert isinstance(cancel, Cancel) and "[1, 3]" in cancel.reason and "outside" in cancel.reason
    assert quiet_for(receiver, 0.2) == []  # it may be writing: held until it answers
    a.send(AbortHeader("r", "cancelled by the receiver"))
    (t,) = poll_until_terminal(receiver, {"r"}).values()
    assert t.state is TransferState.FAILED and "outside" in t.error


# -- the handshake of a tensor-parallel decode node ----------------------------------------------


def test_rank_exports_round_trip_and_malformed_ones_are_frame_errors():
    pools = [a_pool_export(), a_pool_export(session="t")]
    exports = RankExports("s", host_id(), pools, [[0, 1], [1, 2]])
    back = decode_message(encode_message(exports))
    assert back == exports and [h for _, h in back.targets()] == [range(0, 1), range(1, 2)]
    bad = [
        ([a_pool_export()], [[0, 1], [1, 2]], "1 pools for 2 head ranges"),
        (["x"], [[0, 1]], "a str, not a map"),
        ([{"session": "s"}], [[0, 1]], "missing field"),
        ([a_pool_export()], [[1, 1]], "bad head ranges"),
    ]
    for pools, heads, error in bad:
        with pytest.raises(ValueError, match=error):
            RankExports("s", "h", pools, heads)
        fields = {"kind": "rank_exports", "session": "s", "host_id": "h", "heads": heads}
        wire = [dataclasses.asdict(p) if isinstance(p, PoolExport) else p for p in pools]
        with pytest.raises(FrameError, match=error):
            decode_message(SIGNER.sign(msgpack.packb({**fields, "pools": wire})))


def test_a_decode_node_with_a_rank_that_cannot_export_answers_frames_naming_it(opened):
    endpoints, ctx = opened
    receiver = receiver_of(pool(KV_HEADS), endpoints)
    receiver.share_ranks([receiver.pool_export, a_pool_export()], [range(0, 1), range(1, 2)])
    (a,) = raw_ranks(ctx, receiver, 1, endpoints)
    assert isinstance(a.reply, NoExport)
    assert a.reply.reason == "decode rank 0: the receiver's pool is on cpu, not a GPU"
    receiver.share_ranks([a_pool_export(), a_pool_export()], [range(0, 1), range(1, 2)])
    a.send(Hello(host_id(), os.getpid()))
    reply = a.next()
    assert isinstance(reply, RankExports) and reply.heads == [[0, 1], [1, 2]]


# -- where each head goes, and the copy that moves it ---------------------------------------------

PAIRINGS = [(2, 1), (1, 2), (2, 2), (1, 4), (4, 2), (2, 4)]


@pytest.mark.parametrize("p,d", PAIRINGS)
def test_each_shipped_head_goes_to_every_decode_rank_holding_it(p, d):
    src_lay, dst_lay = layout(p), layout(d)
    dst_heads = [dst_lay.kv_heads(q) for q in range(d)]
    for r in shipping_ranks(src_lay):
        mine = src_lay.kv_heads(r)
        reached: dict[int, set[int]] = {}
        for copy in head_copies(mine, dst_heads):
            assert len(copy.src) == len(copy.dst)
            model_heads = [mine.start + h for h in copy.src]
            assert model_heads == [dst_heads[copy.target].start + h for h in copy.dst]
            assert copy.whole == (mine == dst_heads[copy.target])
            for h in model_heads:
                reached.setdefault(h, set()).add(copy.target)
        assert reached == {h: set(dst_lay.kv_head_owners(h)) for h in mine}


def test_heads_no_remote_pool_holds_leave_the_sender_on_frames():
    with pytest.raises(IpcUnavailable, match=r"not \[1\]"):
        head_copies(range(0, 2), [range(0, 1)])


@pytest.mark.parametrize("p,d", [(2, 1), (1, 2), (2, 2), (1, 4)])
def test_the_copies_of_every_rank_fill_every_decode_pool_exactly(p, d):
    """What each prefill rank's `DirectWriter` launches, on one device's pools (the GPU where
    there is one, the interpreter's CPU elsewhere): BlockCopier where both pools hold the same
    heads, HeadCopier for a slice."""
    from common.model.kernels.block_copy import BlockCopier, HeadCopier, block_pairs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    full = pool(KV_HEADS, seed=5).to(device)
    src_pools = [x.contiguous() for x in rank_pools(full, p)]
    dst_pools = [torch.zeros_like(x).contiguous() for x in rank_pools(full, d)]
    dst_heads = [layout(d).kv_heads(q) for q in range(d)]
    pairs = block_pairs(SRC, DST).to(device)
    for r in shipping_ranks(layout(p)):
        for copy in head_copies(layout(p).kv_heads(r), dst_heads):
            src, dst = src_pools[r], dst_pools[copy.target]
            copier = (
                BlockCopier(src, dst) if copy.whole else HeadCopier(src, dst, copy.src, copy.dst)
            )
            copier(pairs, range(LAYERS))
    want = rank_pools(full, d)
    for q in range(d):
        assert torch.equal(dst_pools[q][:, :, DST], want[q][:, :, SRC])
        untouched = [b for b in range(dst_pools[q].shape[2]) if b not in DST]
        assert not dst_pools[q][:, :, untouched].any()


def test_head_copier_refuses_ranges_that_do_not_fit():
    from common.model.kernels.block_copy import HeadCopier

    src, dst = pool(2), pool(1)
    with pytest.raises(ValueError, match="differ in length"):
        HeadCopier(src, dst, range(0, 2), range(0, 1))
    with pytest.raises(ValueError, match="not a step-1 range"):
        HeadCopier(src, dst, range(1, 2), range(1, 2))
    with pytest.raises(ValueError, match="layouts differ"):
        HeadCopier(src, torch.zeros(LAYERS, 2, 8, 4, 1, 4), range(0, 1), range(0, 1))


def test_nodes_of_several_ranks_take_zmq_or_cuda_ipc_only():
    for transport in ("zmq", "cuda_ipc"):
        check_transport(transport, 2)
    check_transport("nixl", 1)
    with pytest.raises(ValueError, match="'nixl' with tp=2"):
        check_transport("nixl", 2)


# -- direct writes on the GPU, sender and receiver in one process -------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
OTHER_GPU = [0, pytest.param(1, marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"))]  # fmt: skip


def ship_directly(senders: list[CudaIpcSender], receiver: CudaIpcReceiver) -> Any:
    """Every rank ships "r" (all layers in one call); the receiver's transfer once all senders
    and the receiver are done."""
    receiver.expect("r", DST)
    for sender in senders:
        assert handshake(sender, receiver).direct
        sender.begin("r", receiver.address, SRC, DST)
        sender.send_layers("r", range(LAYERS))
        sender.complete("r", {"rank": senders.index(sender)} if sender is senders[0] else {})
    sent, done = [], None
    until = time.monotonic() + 20.0
    while done is None or len(sent) < len(senders):
        assert time.monotonic() < until, "never terminal"
        sent += [t for s in senders for t in s.poll()]
        done = next(iter(receiver.poll(timeout_s=0.02)), done)
    assert {t.state for t in sent} == {TransferState.DONE}
    return done


@needs_gpu
@pytest.mark.parametrize("other", OTHER_GPU)
def test_gpu_one_prefill_rank_writes_its_heads_into_each_decode_ranks_pool(other, opened):
    endpoints, _ = opened
    full = pool(KV_HEADS, seed=6).to(torch.bfloat16)
    dst = [x.zero_().to(f"cuda:{d}") for x, d in zip(rank_pools(full, 2), (0, other), strict=True)]
    receiver = receiver_of(dst[0], endpoints)
    # What `tp_receiver` sets up on a decode node's rank 0 (here with no ranks to command).
    link = StepDriver(TPGroup.single(), dst[0].device)
    receiver.set_writer(TPPoolWriter(dst[0], layout(2), link))
    receiver.share_ranks(
        [receiver.pool_export, export_pool(dst[1], "rank-1")], [range(0, 1), range(1, 2)]
    )
    sender = CudaIpcSender(full.to("cuda:0"), IPC)
    endpoints.append(sender)
    done = ship_directly([sender], receiver)
    assert done.state is TransferState.DONE, done.error
    for q, want in enumerate(rank_pools(full, 2)):
        assert torch.equal(dst[q][:, :, DST].cpu(), want[:, :, SRC])
    forget_export("rank-1")


@needs_gpu
@pytest.mark.parametrize("other", OTHER_GPU)
def test_gpu_two_prefill_ranks_write_their_heads_into_one_decode_pool(other, opened):
    endpoints, _ = opened
    full = pool(KV_HEADS, seed=7).to(torch.bfloat16)
    dst = torch.zeros_like(full, device=f"cuda:{other}")
    receiver = receiver_of(dst, endpoints)
    pools = [p.to(f"cuda:{d}") for p, d in zip(rank_pools(full, 2), (0, other), strict=True)]
    senders = [CudaIpcSender(pools[r], rank_transfer(IPC, layout(2), r)) for r in (0, 1)]
    endpoints.extend(senders)
    done = ship_directly(senders, receiver)
    assert done.state is TransferState.DONE and done.metadata == {"rank": 0}, done.error
    assert torch.equal(dst[:, :, DST].cpu(), full[:, :, SRC])
