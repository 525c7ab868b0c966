"""Assembly of the per-request timing record from router marks and node-reported durations."""

from __future__ import annotations

import pytest

from router.timing import TTFT_PHASES, TimingMarks, assemble, percentile, summarize


def pd_marks() -> TimingMarks:
    marks = TimingMarks(arrival=10.0, dispatched=10.002, sent=10.003)
    marks.merge_node_timing(
        {"node_decode": 0.0005, "prefill_queue": 0.010, "prefill_compute": 0.050}
    )
    marks.tokens_arrived(10.070)  # the prefill node's first token
    marks.merge_node_timing({"kv_transfer": 0.004, "kv_transfer_exposed": 0.001})
    marks.merge_node_timing({"decode_admission_wait": 0.002})
    for t in (10.090, 10.110, 10.140):
        marks.tokens_arrived(t)
    marks.finished = 10.140
    return marks


def test_pd_record_takes_phases_from_router_and_nodes():
    record = assemble(pd_marks(), now=99.0)
    assert record.router_queue_tokenize == pytest.approx(0.002)
    assert record.router_encode == pytest.approx(0.001)
    assert record.node_decode == 0.0005
    assert record.prefill_queue == 0.010
    assert record.prefill_compute == 0.050
    assert record.kv_transfer == 0.004
    assert record.decode_admission_wait == 0.002
    assert record.ttft == pytest.approx(0.070)
    assert record.e2e == pytest.approx(0.140)
    assert record.extra == {"kv_transfer_exposed": 0.001}


def test_phases_sum_to_ttft_and_delivery_keeps_only_transit():
    record = assemble(pd_marks(), now=99.0)
    # Handed off at 10.003, first token at 10.070; the node measured 0.0605 of that.
    assert record.first_token_delivery == pytest.approx(0.067 - 0.0605)
    parts = sum(getattr(record, phase) for phase in TTFT_PHASES)
    assert parts == pytest.approx(record.ttft)


def test_decode_intervals_summarize_gaps_between_token_arrivals():
    summary = assemble(pd_marks(), now=99.0).decode_intervals
    assert summary.count == 3
    assert summary.mean == pytest.approx(0.070 / 3)
    assert summary.p50 == pytest.approx(0.020)
    assert summary.max == pytest.approx(0.030)
    assert summary.p99 == pytest.approx(0.030)


def test_unfinished_request_measures_e2e_to_now_and_leaves_unknown_phases_null():
    marks = TimingMarks(arrival=5.0, dispatched=5.5)
    record = assemble(marks, now=7.0)
    assert record.e2e == 2.0
    assert record.ttft is None and record.first_token_delivery is None
    out = record.to_dict()
    assert out["prefill_queue"] is None and out["kv_transfer"] is None
    assert out["decode_intervals"] == {
        "count": 0,
        "mean": None,
        "p50": None,
        "p99": None,
        "max": None,
    }


def test_record_dict_passes_through_extra_node_keys():
    out = assemble(pd_marks(), now=99.0).to_dict()
    assert set(out) >= {
        "router_queue_tokenize",
        "prefill_queue",
        "prefill_compute",
        "kv_transfer",
        "kv_transfer_exposed",
        "decode_admission_wait",
        "first_token_delivery",
        "ttft",
        "e2e",
        "decode_intervals",
    }


def test_non_numeric_node_timing_is_ignored():
    marks = TimingMarks(arrival=0.0)
    marks.merge_node_timing({"prefill_queue": "soon", "flag": True, "kv_transfer": 1})
    assert marks.node_timing == {"kv_transfer": 1.0}


def test_phases_lists_only_measured_values():
    phases = assemble(pd_marks(), now=99.0).phases()
    assert set(phases) == {
        "router_queue_tokenize",
        "router_encode",
        "node_decode",
        "prefill_queue",
        "prefill_compute",
        "kv_transfer",
        "decode_admission_wait",
        "first_token_delivery",
        "kv_transfer_exposed",
    }


def test_nearest_rank_percentiles():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0
    assert summarize([]).count == 0
