"""MLA's latent KV cache (DeepSeek: one plane, one head of kv_lora_rank + rope = 576 values per
token and layer) crosses every transport: pools `[L, 1, blocks, block_size, 1, 576]` built
directly, real sockets on 127.0.0.1, no model.

Byte counts: every transport moves whole blocks, so a transfer's `Transfer.nbytes` is
576 x layers x itemsize x (blocks x block_size) tokens, on the sender and on the receiver.
The cuda_ipc direct path's copy kernel runs on CPU in Triton's interpreter; the whole direct
transfer needs a GPU (skipped without one); nixl's descriptors are checked against real pool
addresses (a nixl WRITE needs the nixl package: tests/test_kv_transfer_nixl.py).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import time
import traceback

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before block_copy's kernel is decorated

import multiprocessing  # noqa: E402

import pytest  # noqa: E402
from test_kv_transfer import (  # noqa: E402  (tests/ is on sys.path under pytest)
    MAX_WAIT_S,
    bind_address,
    handshake,
    poll_both_until_terminal,
)

from common.engine.kv_format import KVFormat  # noqa: E402
from common.model.parallel import TPLayout  # noqa: E402
from kv_transfer import (  # noqa: E402
    KVSender,
    Transfer,
    TransferConfig,
    TransferState,
    create_receiver,
    create_sender,
)
from kv_transfer.cuda_ipc import CudaIpcSender  # noqa: E402
from kv_transfer.nixl_layout import PoolRegion, block_runs, layer_descriptors  # noqa: E402
from kv_transfer.pool_io import check_pool, write_heads  # noqa: E402
from kv_transfer.tp import rank_transfer, shipping_ranks  # noqa: E402
from kv_transfer.zmq_transport import ZmqReceiver, ZmqSender  # noqa: E402

LAYERS, BLOCKS, BS, LATENT = 3, 8, 4, 576  # BLOCKS includes the padding block
SHAPE = (LAYERS, 1, BLOCKS, BS, 1, LATENT)
FP8 = torch.float8_e4m3fn
SRC, DST = [0, 1, 5], [6, 2, 3]  # a run of two blocks and a lone one, both sides
FORMAT = KVFormat(
    kv_dtype="bfloat16", kv_scales="none", quantization="none",
    architecture="DeepseekV2ForCausalLM", num_layers=LAYERS, planes=1, num_kv_heads=1,
    head_dim=LATENT, block_size=BS,
)  # fmt: skip


def latent_pool(dtype: torch.dtype, seed: int | None) -> torch.Tensor:
    if seed is None:
        return torch.zeros(SHAPE, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


def raw(pool: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """The blocks' bytes: bit exact means equal bytes (float8 has NaNs)."""
    return pool[:, :, block_ids].contiguous().view(torch.uint8)


def latent_bytes(dtype: torch.dtype, num_blocks: int) -> int:
    return LATENT * LAYERS * dtype.itemsize * num_blocks * BS


def ship(sender: KVSender, address: str, rid: str, src: list[int], dst: list[int]) -> None:
    sender.begin(rid, address, src, dst)
    sender.send_layers(rid, range(1, LAYERS))  # any order: the announcing frame is not layer 0
    sender.send_layer(rid, 0)
    sender.complete(rid, {"first_token": 3})


@pytest.mark.parametrize("transport", ["zmq", "loopback", "cuda_ipc"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, FP8])
def test_a_latent_pool_crosses_every_transport_bit_exact_counting_its_bytes(transport, dtype):
    """cuda_ipc on CPU pools takes its frames mode."""
    fmt = dataclasses.replace(FORMAT, kv_dtype=str(dtype).removeprefix("torch."))
    config = TransferConfig(transport=transport, kv_format=fmt)
    src, dst = latent_pool(dtype, seed=1), latent_pool(dtype, seed=2)
    before = dst.clone()
    with create_receiver(config, dst, bind_address(transport)) as receiver:
        with create_sender(config, src) as sender:
            if isinstance(sender, CudaIpcSender):
                assert not handshake(sender, receiver).direct
            receiver.expect("r", DST)
            ship(sender, receiver.address, "r", SRC, DST)
            done, sent = poll_both_until_terminal(sender, receiver, {"r"})
    assert done["r"].state is TransferState.DONE, done["r"].error
    assert sent["r"].state is TransferState.DONE and done["r"].metadata == {"first_token": 3}
    assert torch.equal(raw(dst, DST), raw(src, SRC))
    untouched = [b for b in range(BLOCKS) if b not in DST]
    assert torch.equal(raw(dst, untouched), raw(before, untouched))
    want = latent_bytes(dtype, len(SRC))  # 3 blocks x 4 tokens
    assert done["r"].nbytes == sent["r"].nbytes == want


def test_a_kv_shaped_sender_into_a_latent_pool_is_refused_naming_both_geometries():
    """Same architecture, dtype and head size: only the planes differ. The receiver refuses
    at the first frame, before a byte is written."""
    theirs = dataclasses.replace(FORMAT, planes=2)
    src = torch.randn(LAYERS, 2, BLOCKS, BS, 1, LATENT).to(torch.bfloat16)
    dst = latent_pool(torch.bfloat16, seed=2)
    before = dst.clone()
    receiver_config = TransferConfig(kv_format=FORMAT)
    with ZmqReceiver(dst, receiver_config, bind_address("zmq")) as receiver:
        with ZmqSender(src, TransferConfig(kv_format=theirs)) as sender:
            receiver.expect("r", DST)
            ship(sender, receiver.address, "r", SRC, DST)
            done, _ = poll_both_until_terminal(sender, receiver, {"r"})
    error = done["r"].error
    assert done["r"].state is TransferState.FAILED
    assert "cache geometry K/V 1 heads x 576 (prefill node, sender) vs latent 1 x 576 " in error
    assert "(decode node, receiver)" in error
    assert torch.equal(dst, before)


def test_without_formats_a_two_plane_frame_fails_the_payload_check_naming_both_shapes():
    src = torch.randn(LAYERS, 2, BLOCKS, BS, 1, LATENT)
    with ZmqReceiver(latent_pool(torch.float32, 2), TransferConfig(), "tcp://127.0.0.1:0") as r:
        with ZmqSender(src, TransferConfig()) as sender:
            r.expect("r", DST)
            ship(sender, r.address, "r", SRC, DST)
            done, _ = poll_both_until_terminal(sender, r, {"r"})
    assert done["r"].state is TransferState.FAILED
    assert "shape [2, 3, 4, 1, 576] differs from the expected [1, 3, 4, 1, 576]" in done["r"].error


@pytest.mark.parametrize("shape", [(LAYERS, 3, BLOCKS, BS, 1, LATENT), (LAYERS, BLOCKS, BS, 576)])
def test_a_pool_of_another_rank_or_plane_count_is_a_value_error_naming_its_shape(shape):
    with pytest.raises(ValueError, match=re.escape(str(list(shape)))):
        check_pool(torch.zeros(shape))
    with pytest.raises(ValueError, match="planes"):
        create_sender(TransferConfig(), torch.zeros(shape))


# -- the direct paths' address arithmetic -----------------------------------------------------


def region(pool: torch.Tensor) -> PoolRegion:
    plane_block = pool[0, 0, 0].numel() * pool.element_size()
    return PoolRegion(pool.data_ptr(), 0, pool.shape[0], pool.shape[2], plane_block, pool.shape[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_nixl_descriptors_of_a_latent_pool_address_its_one_plane_and_sum_to_the_count(dtype):
    local, remote = latent_pool(dtype, 0), latent_pool(dtype, 1)
    runs = block_runs(SRC, DST)
    src, dst = layer_descriptors(region(local), region(remote), range(LAYERS), runs)
    rows = [(layer, run) for layer in range(LAYERS) for run in runs]  # one plane per layer
    assert src.shape == dst.shape == (len(rows), 3)
    for (layer, run), s, d in zip(rows, src, dst, strict=True):
        assert int(s[0]) == local[layer, 0, run.src].data_ptr()
        assert int(d[0]) == remote[layer, 0, run.dst].data_ptr()
    assert int(src[:, 1].sum()) == int(dst[:, 1].sum()) == latent_bytes(dtype, len(SRC))
    kv_shaped = torch.zeros(LAYERS, 2, BLOCKS, BS, 1, LATENT, dtype=dtype)
    with pytest.raises(ValueError, match="local 3 layers x 1 planes .* remote 3 x 2"):
        layer_descriptors(region(local), region(kv_shaped), range(1), runs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
def test_the_cuda_ipc_copy_kernel_moves_exactly_the_latent_blocks_of_the_listed_layers(dtype):
    from common.model.kernels.block_copy import BlockCopier, block_pairs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    src, dst = latent_pool(dtype, 0).to(device), latent_pool(dtype, 1).to(device)
    want = dst.clone()
    want[1:, :, DST] = src[1:, :, SRC]
    BlockCopier(src, dst)(block_pairs(SRC, DST).to(device), range(1, LAYERS))
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ValueError, match="layouts differ"):
        BlockCopier(src, torch.zeros(LAYERS, 2, BLOCKS, BS, 1, LATENT, dtype=dtype, device=device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_ipc_writes_a_latent_pool_directly_counting_its_bytes():
    """Sender and receiver in this process on cuda:0: the export is found in-process."""
    config = TransferConfig(transport="cuda_ipc", kv_format=FORMAT, deadline_s=60.0)
    src = latent_pool(torch.bfloat16, 1).cuda()
    dst = latent_pool(torch.bfloat16, 2).cuda()
    before = dst.clone()
    with create_receiver(config, dst, "tcp://127.0.0.1:0") as receiver:
        with create_sender(config, src) as sender:
            assert handshake(sender, receiver).direct
            receiver.expect("r", DST)
            ship(sender, receiver.address, "r", SRC, DST)
            done, sent = poll_both_until_terminal(sender, receiver, {"r"})
    assert done["r"].state is sent["r"].state is TransferState.DONE
    assert torch.equal(raw(dst, DST), raw(src, SRC))
    untouched = [b for b in range(BLOCKS) if b not in DST]
    assert torch.equal(raw(dst, untouched), raw(before, untouched))
    assert done["r"].nbytes == sent["r"].nbytes == latent_bytes(torch.bfloat16, len(SRC))


# -- tensor-parallel nodes: one latent head, replicated on every rank --------------------------


def layout(tp: int) -> TPLayout:
    return TPLayout(tp, 16, 1, 64, 100)  # 16 query heads, MLA's one "KV head"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_tp_prefill_node_ships_the_latent_once_from_its_first_rank(tp):
    assert shipping_ranks(layout(tp)) == [0]
    assert rank_transfer(TransferConfig(), layout(tp), 0).senders == 1
    assert all(rank_transfer(TransferConfig(), layout(tp), r) is None for r in range(1, tp))


def test_two_prefill_ranks_into_one_decode_pool_send_the_latent_once():
    """P2 -> D1: rank 0's sender alone ships (rank 1 holds a copy); DONE on its one notice."""
    full = latent_pool(torch.bfloat16, seed=3)
    ranks = [full.clone() for _ in range(2)]  # each rank holds the whole latent
    dst = latent_pool(torch.bfloat16, None)
    with ZmqReceiver(dst, TransferConfig(), "tcp://127.0.0.1:0") as receiver:
        (rank,) = shipping_ranks(layout(2))
        with ZmqSender(ranks[rank], rank_transfer(TransferConfig(), layout(2), rank)) as sender:
            receiver.expect("r", DST)
            ship(sender, receiver.address, "r", SRC, DST)
            done, sent = poll_both_until_terminal(sender, receiver, {"r"})
    assert done["r"].state is TransferState.DONE
    assert torch.equal(raw(dst, DST), raw(full, SRC))
    assert done["r"].nbytes == sent["r"].nbytes == latent_bytes(torch.bfloat16, len(SRC))


@pytest.mark.parametrize("p, d", [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_every_decode_rank_writes_the_whole_latent_whatever_the_two_tp_sizes(p, d):
    """The mapping rank 0's writer and each decode rank apply to the shipping rank's frames."""
    full = latent_pool(FP8, seed=4)
    decode = [latent_pool(FP8, None) for _ in range(d)]
    for r in shipping_ranks(layout(p)):
        head_start = layout(p).kv_heads(r).start
        for layer in range(LAYERS):
            frame = full[layer][:, SRC]
            for q in range(d):
                # rank 0 writes the received frame; the others get its bytes (uint8)
                payload = frame if q == 0 else frame.view(torch.uint8)
                write_heads(decode[q], layout(d).kv_heads(q), layer, DST, head_start, payload)
    for q in range(d):
        assert torch.equal(raw(decode[q], DST), raw(full, SRC)), q


def _decode_rank(rank: int, init_method: str, address_box, outbox) -> None:
    """One rank of a 2-rank decode node over gloo: rank 0 binds the KV receiver and forwards
    through `TPPoolWriter`; rank 1 follows rank 0's commands with `DecodeRank`."""
    try:
        from common.engine.tp_link import StepDriver, StepFollower
        from common.model.distributed import TPGroup
        from kv_transfer.tp import DecodeRank, TPPoolWriter

        cpu = torch.device("cpu")
        tp = TPGroup.init(rank, 2, init_method, cpu)
        pool = latent_pool(torch.bfloat16, None)
        if rank == 0:
            driver = StepDriver(tp, cpu)
            with ZmqReceiver(pool, TransferConfig(), "tcp://127.0.0.1:0") as receiver:
                receiver.set_writer(TPPoolWriter(pool, layout(2), driver))
                receiver.expect("r", DST)
                address_box.put(receiver.address)
                ended: list = []
                while not ended:
                    ended = receiver.poll(timeout_s=0.05)
            driver.stop()
            (t,) = ended
            outbox.put((rank, t.state.name, t.error, t.nbytes, raw(pool, DST).numpy().tobytes()))
        else:
            handler = DecodeRank(pool, layout(2).kv_heads(rank))
            follower = StepFollower(tp, cpu)
            while (message := follower.receive()) is not None:
                handler.command(*message)
            outbox.put((rank, None, None, 0, raw(pool, DST).numpy().tobytes()))
    except BaseException:
        outbox.put((rank, "crashed", traceback.format_exc(), 0, None))


def test_one_prefill_rank_into_two_decode_ranks_writes_the_latent_into_both(tmp_path):
    """P1 -> D2 through the real step link (two gloo rank processes): one frame per layer on
    the wire, both ranks' pools hold the latent bit for bit when rank 0 reports DONE."""
    ctx = multiprocessing.get_context("spawn")
    address_box, outbox = ctx.Queue(), ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    ranks = [ctx.Process(target=_decode_rank, args=(r, init, address_box, outbox)) for r in (0, 1)]
    for process in ranks:
        process.start()
    src = latent_pool(torch.bfloat16, seed=5)
    reports: dict[int, list] = {}
    sent: dict[str, Transfer] = {}
    try:
        with ZmqSender(src, TransferConfig()) as sender:
            ship(sender, address_box.get(timeout=MAX_WAIT_S), "r", SRC, DST)
            until = time.monotonic() + MAX_WAIT_S
            while len(reports) < 2:
                assert time.monotonic() < until, f"ranks reported only {reports}"
                sent.update((t.request_id, t) for t in sender.poll())
                try:
                    rank, *report = outbox.get(timeout=0.05)
                except queue.Empty:
                    continue
                reports[rank] = report
            sent.update((t.request_id, t) for t in sender.poll())
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    state, error, nbytes, _ = reports[0]
    assert state == "DONE", error
    assert reports[1][0] is None, reports[1][1]  # rank 1 did not crash
    want = latent_bytes(torch.bfloat16, len(SRC))
    assert nbytes == sent["r"].nbytes == want  # one copy on the wire, two ranks written
    for rank in (0, 1):
        assert reports[rank][3] == raw(src, SRC).numpy().tobytes(), rank
