"""The nixl transport: descriptor arithmetic (no nixl needed) against real pool tensors, then,
where the nixl package imports and its UCX agent starts, real NIXL WRITEs between two agents
in this process (UCX over shared memory / TCP on a CPU), the cancel and failure contracts, and
the fallback to frames when the receiver has no NIXL export."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from common.node.config import NodeConfig
from kv_transfer import TRANSPORTS, Transfer, TransferConfig, TransferState
from kv_transfer.nixl_layout import PoolRegion, Run, block_runs, layer_descriptors
from kv_transfer.nixl_transport import NixlReceiver, NixlSender, NixlUnavailable, _Agent

NUM_LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 4, 2, 8
MAX_WAIT_S = 30.0  # only a hang reaches it


def make_pool(num_blocks: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_LAYERS, 2, num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM)
    return torch.randn(shape, generator=g).to(dtype)


def region(pool: torch.Tensor) -> PoolRegion:
    block_bytes = pool[0, 0, 0].numel() * pool.element_size()
    return PoolRegion(pool.data_ptr(), 0, pool.shape[0], pool.shape[2], block_bytes)


def test_block_pairs_merge_into_runs_only_where_both_sides_are_consecutive():
    assert block_runs([0, 1, 2, 7], [5, 6, 7, 8]) == [Run(0, 5, 3), Run(7, 8, 1)]
    assert block_runs([3, 4], [9, 2]) == [Run(3, 9, 1), Run(4, 2, 1)]
    assert block_runs([], []) == []
    with pytest.raises(ValueError, match="2 source blocks, 1 destination"):
        block_runs([1, 2], [3])


def test_descriptors_address_exactly_the_k_and_v_of_each_block_in_both_pools():
    local, remote = make_pool(10, 0), make_pool(6, 1)
    runs = block_runs([2, 3, 9], [4, 5, 0])
    src, dst = layer_descriptors(region(local), region(remote), range(1, 3), runs)
    rows = [(layer, kv, run) for layer in (1, 2) for kv in (0, 1) for run in runs]
    assert src.shape == dst.shape == (len(rows), 3)
    for (layer, kv, run), s, d in zip(rows, src, dst, strict=True):
        want_src = local[layer, kv, run.src : run.src + run.length]
        want_dst = remote[layer, kv, run.dst : run.dst + run.length]
        assert int(s[0]) == want_src.data_ptr() and int(d[0]) == want_dst.data_ptr()
        assert int(s[1]) == int(d[1]) == want_src.numel() * 4


@pytest.mark.parametrize(
    "layers, runs, needle",
    [
        (range(0, 4), [Run(0, 0, 1)], "layers range"),
        (range(0, 1), [Run(9, 0, 2)], "outside the pools"),
        (range(0, 1), [Run(0, 5, 2)], "outside the pools"),
    ],
)
def test_descriptors_refuse_layers_and_blocks_outside_either_pool(layers, runs, needle):
    with pytest.raises(ValueError, match=needle):
        layer_descriptors(region(make_pool(10, 0)), region(make_pool(6, 1)), layers, runs)


def test_fp8_pools_are_addressed_by_their_one_byte_elements():
    fp8 = torch.float8_e4m3fn
    local, remote = make_pool(10, 0, fp8), make_pool(6, 1, fp8)
    src, dst = layer_descriptors(region(local), region(remote), range(2), [Run(2, 4, 2)])
    for (layer, kv), s, d in zip([(0, 0), (0, 1), (1, 0), (1, 1)], src, dst, strict=True):
        assert int(s[0]) == local[layer, kv, 2].data_ptr()
        assert int(d[0]) == remote[layer, kv, 4].data_ptr()
        assert int(s[1]) == int(d[1]) == 2 * BLOCK_SIZE * HEADS * HEAD_DIM  # bytes
    bf16 = make_pool(6, 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pool layouts differ"):
        layer_descriptors(region(local), region(bf16), range(1), [Run(0, 0, 1)])


def test_descriptors_refuse_pools_of_different_block_layouts():
    other = make_pool(6, 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pool layouts differ"):
        layer_descriptors(region(make_pool(10, 0)), region(other), range(1), [Run(0, 0, 1)])


def test_nixl_is_registered_and_the_node_config_names_a_missing_package(monkeypatch):
    assert TRANSPORTS["nixl"] == (NixlSender, NixlReceiver)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install 'pdserve\[nixl\]'"):
        NodeConfig(transport="nixl")


def nixl_reason() -> str | None:
    try:
        _Agent("probe", make_pool(2, 0)).close()
    except NixlUnavailable as exc:
        return str(exc)
    return None


needs_nixl = pytest.mark.skipif(
    (reason := nixl_reason()) is not None, reason=f"nixl cannot run here: {reason}"
)


def handshake(sender: NixlSender, receiver: NixlReceiver) -> None:
    """The receiver answers the handshake inside poll(): serve it from a thread meanwhile."""
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            assert receiver.poll(timeout_s=0.01) == []

    server = threading.Thread(target=serve)
    server.start()
    try:
        assert sender.connect(receiver.address) is not None
    finally:
        stop.set()
        server.join()


@pytest.fixture
def pair():
    made = []

    def make(src_blocks=12, dst_blocks=8, deadline_s=30.0):
        config = TransferConfig(transport="nixl", deadline_s=deadline_s)
        src, dst = make_pool(src_blocks, 0), torch.zeros(make_pool(dst_blocks, 1).shape)
        receiver = NixlReceiver(dst, config, "tcp://127.0.0.1:0", cancel_grace_s=2.0)
        sender = NixlSender(src, config)
        made.extend([sender, receiver])
        handshake(sender, receiver)
        return sender, receiver, src, dst

    yield make
    for end in made:
        end.close()


def until_terminal(sender, receiver, ids: set[str]) -> tuple[dict, dict]:
    sent: dict[str, Transfer] = {}
    got: dict[str, Transfer] = {}
    deadline = time.monotonic() + MAX_WAIT_S
    while not (ids <= sent.keys() and ids <= got.keys()):
        assert time.monotonic() < deadline, f"never terminal: {sent.keys()} {got.keys()}"
        sent.update((t.request_id, t) for t in sender.poll())
        got.update((t.request_id, t) for t in receiver.poll(timeout_s=0.01))
    return sent, got


@needs_nixl
def test_nixl_writes_land_exactly_in_the_reserved_blocks_and_nowhere_else(pair):
    sender, receiver, src, dst = pair()
    mappings = {"a": ([0, 1, 2], [5, 6, 7]), "b": ([9, 4], [0, 3])}
    assert sender.route(receiver.address).direct, sender.route(receiver.address).reason
    for rid, (s, d) in mappings.items():
        receiver.expect(rid, d)
        sender.begin(rid, receiver.address, s, d)
    for layer in (2, 0, 1):  # any order
        sender.send_layer("a", layer)
    sender.send_layers("b", range(NUM_LAYERS))
    for rid in mappings:
        sender.complete(rid, {"first_token": 7})
    sent, got = until_terminal(sender, receiver, set(mappings))
    assert {t.state for t in [*sent.values(), *got.values()]} == {TransferState.DONE}
    assert got["a"].metadata == {"first_token": 7}
    for s, d in mappings.values():
        assert torch.equal(dst[:, :, d], src[:, :, s])
    untouched = [b for b in range(8) if b not in (5, 6, 7, 0, 3)]
    assert not dst[:, :, untouched].any()


@needs_nixl
def test_a_cancel_on_the_decode_side_holds_the_blocks_until_the_sender_confirms(pair):
    sender, receiver, src, dst = pair()
    receiver.expect("r", [1, 2])
    sender.begin("r", receiver.address, [0, 1], [1, 2])
    sender.send_layer("r", 0)
    assert receiver.cancel("r") is False  # the sender may be writing: not free yet
    sent, got = until_terminal(sender, receiver, {"r"})
    assert sent["r"].state is TransferState.FAILED and got["r"].error == "cancelled"


@needs_nixl
def test_the_sender_deadline_fails_both_sides_without_a_complete(pair):
    sender, receiver, src, dst = pair(deadline_s=0.5)
    receiver.expect("late", [4])
    sender.begin("late", receiver.address, [3], [4])
    sender.send_layer("late", 0)  # never all layers, never complete
    sent, got = until_terminal(sender, receiver, {"late"})
    assert sent["late"].state is got["late"].state is TransferState.FAILED


@needs_nixl
def test_a_receiver_without_a_nixl_export_gets_frames_with_the_same_result(pair, monkeypatch):
    monkeypatch.setattr(
        "kv_transfer.nixl_transport._Agent.__init__",
        lambda self, role, pool: (_ for _ in ()).throw(NixlUnavailable("no UCX here")),
    )
    sender, receiver, src, dst = pair()
    receiver.expect("f", [6, 7])
    sender.begin("f", receiver.address, [10, 11], [6, 7])
    route = sender.route(receiver.address)
    assert not route.direct and "no UCX here" in route.reason
    sender.send_layers("f", range(NUM_LAYERS))
    sender.complete("f", {})
    sent, got = until_terminal(sender, receiver, {"f"})
    assert got["f"].state is TransferState.DONE
    assert torch.equal(dst[:, :, [6, 7]], src[:, :, [10, 11]])
