"""KV transfer between tensor-parallel sizes over real zmq sockets, no model: each prefill
rank ships its KV heads (frames carry their head range), the receiver's ledger counts heads
per layer and reports DONE only once every head of every layer arrived from every sender."""

from __future__ import annotations

import pytest
import torch
import zmq

from common.model.parallel import TPLayout
from kv_transfer import TransferConfig, TransferState
from kv_transfer.frames import CompleteHeader, encode_header
from kv_transfer.pool_io import write_heads
from kv_transfer.tp import rank_transfer, shipping_ranks
from kv_transfer.zmq_transport import ZmqReceiver, ZmqSender

LAYERS, BLOCKS, BS, KV_HEADS, DIM = 2, 8, 4, 2, 8
SRC, DST = [1, 4, 6], [0, 5, 2]


def pool(heads: int, seed: int | None = None) -> torch.Tensor:
    shape = (LAYERS, 2, BLOCKS, BS, heads, DIM)
    if seed is None:
        return torch.zeros(shape)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def layout(tp: int) -> TPLayout:
    return TPLayout(tp, 4, KV_HEADS, 16, 100)


def rank_pools(full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """What each rank of a TP node holds of a full pool: its KV heads."""
    lay = layout(tp)
    return [full[..., lay.kv_heads(r).start : lay.kv_heads(r).stop, :].clone() for r in range(tp)]


def senders(full: torch.Tensor, tp: int) -> list[ZmqSender]:
    """The senders of a prefill node of `tp` ranks over the rank pools of `full`."""
    pools, lay = rank_pools(full, tp), layout(tp)
    return [
        ZmqSender(pools[r], rank_transfer(TransferConfig(), lay, r)) for r in shipping_ranks(lay)
    ]


def ship(sender: ZmqSender, address: str, rid: str, metadata: dict) -> None:
    sender.begin(rid, address, SRC, DST)
    sender.send_layers(rid, range(LAYERS))
    sender.complete(rid, metadata)


def poll(receiver: ZmqReceiver, rounds: int = 20) -> list:
    out = []
    for _ in range(rounds):
        out += receiver.poll(timeout_s=0.02)
    return out


def test_two_prefill_ranks_fill_one_decode_pool_and_it_is_done_only_after_both():
    full = pool(KV_HEADS, seed=0)
    dst = pool(KV_HEADS)
    with ZmqReceiver(dst, TransferConfig(), "tcp://127.0.0.1:0") as receiver:
        first, second = senders(full, 2)
        receiver.expect("r", DST)
        ship(first, receiver.address, "r", {"first_token": 7})
        assert poll(receiver) == []  # head 1 of every layer is still missing
        ship(second, receiver.address, "r", {})
        (done,) = poll(receiver)
        assert done.state is TransferState.DONE and done.metadata == {"first_token": 7}
        assert torch.equal(dst[:, :, DST], full[:, :, SRC])
        for s in (first, second):
            s.close()


def test_all_notices_in_but_heads_missing_fails_the_transfer_as_incomplete():
    full = pool(KV_HEADS, seed=1)
    with ZmqReceiver(pool(KV_HEADS), TransferConfig(), "tcp://127.0.0.1:0") as receiver:
        first, second = senders(full, 2)
        receiver.expect("r", DST)
        ship(first, receiver.address, "r", {})
        # The second rank's notice arrives without its frames (a raw frame on the wire).
        context = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.connect(receiver.address)
        push.send(encode_header(CompleteHeader("r", {}, senders=2)))
        (failed,) = poll(receiver)
        assert failed.state is TransferState.FAILED and "incomplete" in failed.error
        push.close(linger=0)
        context.term()
        for s in (first, second):
            s.close()


def test_the_same_heads_twice_fail_the_transfer():
    full = pool(KV_HEADS, seed=2)
    with ZmqReceiver(pool(KV_HEADS), TransferConfig(), "tcp://127.0.0.1:0") as receiver:
        first, _ = senders(full, 2)
        again = ZmqSender(rank_pools(full, 2)[0], rank_transfer(TransferConfig(), layout(2), 0))
        receiver.expect("r", DST)
        ship(first, receiver.address, "r", {})
        again.begin("r", receiver.address, SRC, DST)
        again.send_layer("r", 0)
        (failed,) = poll(receiver)
        assert failed.state is TransferState.FAILED and "arrived twice" in failed.error
        for s in (first, again):
            s.close()


@pytest.mark.parametrize("p,d", [(2, 1), (1, 2), (2, 4), (4, 2), (1, 4)])
def test_every_decode_rank_gets_exactly_its_heads_whatever_the_two_tp_sizes(p, d):
    """The mapping a TP decode node applies (rank 0's writer and its ranks all call
    `write_heads` with their own heads) on the frames of a TP prefill node's shipping ranks."""
    full = pool(KV_HEADS, seed=3)
    src_pools, dst_layout = rank_pools(full, p), layout(d)
    dst_pools = [torch.zeros_like(x) for x in rank_pools(full, d)]
    for r in shipping_ranks(layout(p)):
        head_start = layout(p).kv_heads(r).start
        for layer in range(LAYERS):
            frame = src_pools[r][layer][:, SRC]
            for q in range(d):
                write_heads(dst_pools[q], dst_layout.kv_heads(q), layer, DST, head_start, frame)
    want = rank_pools(full, d)
    for q in range(d):
        assert torch.equal(dst_pools[q][:, :, DST], want[q][:, :, SRC])


def test_replicated_heads_ship_once():
    assert shipping_ranks(layout(4)) == [0, 2]  # ranks 1 and 3 hold copies of heads 0 and 1
    assert rank_transfer(TransferConfig(), layout(4), 1) is None
    assert rank_transfer(TransferConfig(), layout(4), 2).head_start == 1
    assert rank_transfer(TransferConfig(), layout(4), 2).senders == 2
