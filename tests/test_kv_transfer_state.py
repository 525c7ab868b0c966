"""The transfer state machine, ledgers and frame codec: pure Python, no torch, no sockets."""

import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from kv_transfer.base import Transfer, TransferConfig, TransferState
from kv_transfer.frames import (
    AbortHeader,
    CompleteHeader,
    FrameError,
    LayerHeader,
    decode_header,
    encode_header,
)
from kv_transfer.ledger import ReceiverLedger, SenderLedger

REPO_ROOT = Path(__file__).resolve().parents[1]
S = TransferState


def make_transfer(**kwargs) -> Transfer:
    return Transfer("r1", [0, 1], num_layers=2, deadline=time.monotonic() + 10, **kwargs)


def test_state_machine_modules_import_without_torch():
    code = (
        "import sys, kv_transfer, kv_transfer.base, kv_transfer.ledger, kv_transfer.frames; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def test_transfer_walks_pending_in_flight_done_and_records_finish_time():
    t = make_transfer()
    assert not t.is_terminal and t.finished_at is None
    t.move_to(S.IN_FLIGHT)
    assert not t.is_terminal
    t.move_to(S.DONE)
    assert t.is_terminal and t.finished_at is not None and t.error is None


@pytest.mark.parametrize("start", [S.PENDING, S.IN_FLIGHT])
def test_transfer_can_fail_from_any_live_state(start):
    t = make_transfer(state=start)
    t.move_to(S.FAILED, "boom")
    assert t.state is S.FAILED and t.error == "boom" and t.finished_at is not None


@pytest.mark.parametrize(
    "start, target",
    [
        (S.PENDING, S.DONE),
        (S.PENDING, S.PENDING),
        (S.IN_FLIGHT, S.PENDING),
        (S.IN_FLIGHT, S.IN_FLIGHT),
        (S.DONE, S.FAILED),
        (S.DONE, S.IN_FLIGHT),
        (S.FAILED, S.DONE),
        (S.FAILED, S.FAILED),
    ],
)
def test_illegal_transitions_raise_naming_both_states(start, target):
    t = make_transfer(state=start)
    with pytest.raises(ValueError, match=f"{start.name} -> {target.name}"):
        t.move_to(target)
    assert t.state is start


@pytest.mark.parametrize("kwargs", [{"deadline_s": 0}, {"fail_rate": -0.1}, {"fail_rate": 1.5}])
def test_config_rejects_out_of_range_values(kwargs):
    with pytest.raises(ValueError):
        TransferConfig(**kwargs)


def test_sender_ledger_rejects_misuse_with_the_offending_values():
    ledger = SenderLedger(TransferConfig(), num_layers=2, num_blocks=4)
    with pytest.raises(ValueError, match="2 source blocks, 1 destination"):
        ledger.begin("r", "addr", [0, 1], [5])
    with pytest.raises(ValueError, match=r"\[4\] outside"):
        ledger.begin("r", "addr", [0, 4], [5, 6])
    with pytest.raises(ValueError, match="repeat"):
        ledger.begin("r", "addr", [1, 2], [5, 5])
    entry = ledger.begin("r", "addr", [0, 1], [5, 6])
    with pytest.raises(ValueError, match="already active"):
        ledger.begin("r", "addr", [2], [7])
    with pytest.raises(ValueError, match="outside"):
        ledger.check_layer(entry, 2)
    ledger.layer_sent(entry, 0)
    with pytest.raises(ValueError, match="sent twice"):
        ledger.check_layer(entry, 0)
    with pytest.raises(ValueError, match=r"layers \[1\] not sent"):
        ledger.check_complete(entry)
    with pytest.raises(ValueError, match="never begun"):
        ledger.lookup("unknown")


def test_sender_ledger_treats_terminal_transfers_as_no_ops_until_polled():
    ledger = SenderLedger(TransferConfig(), num_layers=1, num_blocks=4)
    ledger.begin("r", "addr", [0], [1])
    ledger.table.finish("r", S.FAILED, "x")
    assert ledger.lookup("r") is None  # terminal, not yet reported: calls on it do nothing
    assert [t.request_id for t in ledger.table.drain()] == ["r"]
    with pytest.raises(ValueError):
        ledger.lookup("r")  # reported and forgotten


def doomed_pattern(fail_rate: float, seed: int) -> list[bool]:
    ledger = SenderLedger(
        TransferConfig(fail_rate=fail_rate, seed=seed), num_layers=1, num_blocks=1
    )
    return [ledger.begin(f"r{i}", "a", [0], [0]).doomed for i in range(40)]


def test_failure_injection_is_deterministic_per_seed():
    assert doomed_pattern(0.5, seed=3) == doomed_pattern(0.5, seed=3)
    assert 0 < sum(doomed_pattern(0.5, seed=3)) < 40
    assert all(doomed_pattern(1.0, seed=0))
    assert not any(doomed_pattern(0.0, seed=0))


def test_receiver_ledger_fails_completion_with_missing_layers():
    ledger = ReceiverLedger(TransferConfig(), num_layers=2, num_blocks=8)
    ledger.expect("r", [3, 4])
    entry = ledger.accept_layer(LayerHeader("r", 0, [3, 4], "torch.float32", [2, 2, 1, 1, 1]))
    assert entry is not None
    ledger.layer_written(entry, 0)
    ledger.complete("r", {"first_token": 1})
    (t,) = ledger.table.drain()
    assert t.state is S.FAILED and "incomplete" in t.error and t.metadata is None


def test_receiver_ledger_drops_frames_for_unexpected_or_cancelled_requests():
    ledger = ReceiverLedger(TransferConfig(), num_layers=1, num_blocks=8)
    ledger.expect("r", [1])
    ledger.table.forget("r")
    assert ledger.accept_layer(LayerHeader("r", 0, [1], "torch.float32", [2, 1])) is None
    ledger.complete("stranger", {})
    ledger.abort("r", "late")
    assert ledger.table.drain() == []


def test_receiver_ledger_fails_layers_that_do_not_match_the_reservation():
    ledger = ReceiverLedger(TransferConfig(), num_layers=2, num_blocks=8)
    for rid in ("ids", "range"):
        ledger.expect(rid, [1, 2])
    assert ledger.accept_layer(LayerHeader("ids", 0, [2, 1], "torch.float32", [])) is None
    assert ledger.accept_layer(LayerHeader("range", 2, [1, 2], "torch.float32", [])) is None
    errors = {t.request_id: t.error for t in ledger.table.drain()}
    assert "block ids differ" in errors["ids"] and "outside" in errors["range"]


def test_receiver_ledger_rejects_reservations_outside_the_pool():
    ledger = ReceiverLedger(TransferConfig(), num_layers=1, num_blocks=4)
    with pytest.raises(ValueError, match="outside"):
        ledger.expect("r", [3, 4])
    with pytest.raises(ValueError, match="no blocks"):
        ledger.expect("r", [])


@pytest.mark.parametrize(
    "header",
    [
        LayerHeader("r", 1, [4, 5], "torch.bfloat16", [2, 2, 16, 2, 64]),
        CompleteHeader("r", {"first_token": 7, "timing": {"prefill": 0.5}, "top": [[1, -0.5]]}),
        AbortHeader("r", "client went away"),
    ],
)
def test_headers_round_trip(header):
    assert decode_header(encode_header(header)) == header


@pytest.mark.parametrize("metadata", [{"x": object()}, {"timing": {1: 0.5}}])
def test_metadata_the_receiver_could_not_decode_is_a_value_error(metadata):
    with pytest.raises(ValueError, match="msgpack"):
        encode_header(CompleteHeader("r", metadata))


@pytest.mark.parametrize(
    "frame, request_id",
    [
        (b"\xc1\xff garbage", None),
        (msgpack.packb([1, 2, 3]), None),
        (msgpack.packb({"kind": "teleport", "request_id": "r"}), "r"),
        (msgpack.packb({"kind": ["layer"], "request_id": "r"}), "r"),
        (msgpack.packb({"kind": "layer", "request_id": "r", "layer": "0"}), "r"),
        (msgpack.packb({"kind": "abort", "request_id": "r", "reason": "x", "extra": 1}), "r"),
        (msgpack.packb({"kind": "abort", "request_id": 5, "reason": "x"}), None),
    ],
)
def test_malformed_headers_raise_frame_error_naming_the_request_when_known(frame, request_id):
    with pytest.raises(FrameError) as info:
        decode_header(frame)
    assert info.value.request_id == request_id
