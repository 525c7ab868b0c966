"""Node liveness bookkeeping: heartbeats with explicit timestamps, no sleeping."""

from __future__ import annotations

from router.registry import NodeRegistry
from tests.router_fakes import heartbeat

P, D = "tcp://127.0.0.1:5601", "tcp://127.0.0.1:5701"


def pd_registry() -> NodeRegistry:
    return NodeRegistry([P], [D], timeout=3.0)


def test_nodes_are_unhealthy_until_their_first_heartbeat():
    registry = pd_registry()
    assert registry.healthy("prefill", 0.0) == []
    assert not registry.has_path(0.0)
    assert [n["healthy"] for n in registry.report(0.0)] == [False, False]


def test_node_is_healthy_after_a_heartbeat_and_dead_after_the_timeout():
    registry = pd_registry()
    registry.observe(heartbeat(P, "prefill"), now=100.0)
    assert [n.node_id for n in registry.healthy("prefill", 103.0)] == [P]
    assert registry.healthy("prefill", 103.01) == []


def test_pd_path_needs_a_healthy_prefill_and_a_healthy_decode_node():
    registry = pd_registry()
    registry.observe(heartbeat(P, "prefill"), now=100.0)
    assert not registry.has_path(100.0)
    registry.observe(heartbeat(D, "decode"), now=101.0)
    assert registry.has_path(101.0)
    assert not registry.has_path(103.5)  # the prefill node went silent


def test_colocated_path_needs_one_healthy_colocated_node():
    registry = NodeRegistry([], [D], timeout=3.0)
    assert registry.colocated
    registry.observe(heartbeat(D, "colocated"), now=5.0)
    assert registry.has_path(5.0)


def test_sweep_reports_each_death_once():
    registry = pd_registry()
    registry.observe(heartbeat(P, "prefill"), now=100.0)
    registry.observe(heartbeat(D, "decode"), now=102.0)
    assert registry.sweep(104.0) == [P]
    assert registry.sweep(104.5) == []
    assert registry.sweep(106.0) == [D]


def test_a_node_that_comes_back_is_healthy_again():
    registry = pd_registry()
    registry.observe(heartbeat(P, "prefill"), now=100.0)
    assert registry.sweep(110.0) == [P]
    assert registry.observe(heartbeat(P, "prefill"), now=111.0) is False
    assert registry.healthy("prefill", 111.0)


def test_heartbeat_after_a_silence_not_yet_swept_still_loses_in_flight_requests():
    registry = pd_registry()
    registry.observe(heartbeat(P, "prefill"), now=100.0)
    assert registry.observe(heartbeat(P, "prefill"), now=102.0) is False
    assert registry.observe(heartbeat(P, "prefill"), now=106.0) is True


def test_restart_is_detected_by_a_changed_instance_id():
    registry = pd_registry()
    registry.observe(heartbeat(P, "prefill", instance_id="a"), now=1.0)
    assert registry.observe(heartbeat(P, "prefill", instance_id="a"), now=1.5) is False
    assert registry.observe(heartbeat(P, "prefill", instance_id="b"), now=2.0) is True


def test_wrong_role_makes_a_heartbeating_node_unusable():
    registry = pd_registry()
    registry.observe(heartbeat(D, "colocated"), now=1.0)
    assert registry.healthy("decode", 1.0) == []
    (entry,) = [n for n in registry.report(1.0) if n["id"] == D]
    assert entry["healthy"] is False and "role" in entry["problem"]


def test_decode_node_without_kv_address_is_unusable_in_pd_mode():
    registry = pd_registry()
    hb = heartbeat(D, "decode")
    del hb.info["kv_address"]
    registry.observe(hb, now=1.0)
    assert registry.healthy("decode", 1.0) == []


def test_heartbeat_without_context_length_is_unusable():
    registry = pd_registry()
    hb = heartbeat(P, "prefill")
    hb.info["max_model_len"] = "big"
    registry.observe(hb, now=1.0)
    assert registry.healthy("prefill", 1.0) == []


def test_heartbeat_from_an_unlisted_node_is_ignored():
    registry = pd_registry()
    assert registry.observe(heartbeat("tcp://elsewhere:1", "prefill"), now=1.0) is False
    assert set(registry.nodes) == {P, D}


def test_report_carries_role_age_info_and_load():
    registry = pd_registry()
    registry.observe(
        heartbeat(D, "decode", free_blocks=42, running=3, pid=4321, device="cpu"), now=10.0
    )
    (entry,) = [n for n in registry.report(10.5) if n["id"] == D]
    info = entry.pop("info")  # the heartbeat's static info (the launcher's per-node summary)
    assert info["pid"] == 4321 and info["max_model_len"] == 2048
    assert entry == {
        "id": D,
        "role": "decode",
        "healthy": True,
        "last_heartbeat_age_s": 0.5,
        "pid": 4321,
        "device": "cpu",
        "load": {"free_blocks": 42, "running": 3, "waiting": 0, "queued_tokens": 0},
    }
