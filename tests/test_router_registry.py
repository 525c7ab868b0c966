"""Node liveness bookkeeping: heartbeats with explicit timestamps, no sleeping."""

from __future__ import annotations

import pytest

from router.config import RouterConfig
from router.core import RouterCore
from router.errors import OpenAIError
from router.metrics import RouterMetrics
from router.registry import NodeRegistry
from tests.router_fakes import LoopbackNodes, ManualClock, heartbeat

P, D = "tcp://127.0.0.1:5601", "tcp://127.0.0.1:5701"


def pd_registry() -> NodeRegistry:
    return NodeRegistry([P], [D], timeout=3.0, colocated=False)


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
    registry = NodeRegistry([], [D], timeout=3.0, colocated=True)
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


def test_a_node_not_on_the_command_line_registers_with_its_heartbeat():
    registry = pd_registry()
    other = "tcp://10.0.0.2:5601"
    assert registry.observe(heartbeat(other, "prefill"), now=1.0) is False
    assert registry.nodes[other].role == "prefill"
    assert [n.node_id for n in registry.healthy("prefill", 1.0)] == [other]


def test_a_registered_node_of_a_role_the_mode_does_not_use_is_unusable():
    registry = pd_registry()
    registry.observe(heartbeat("tcp://x:1", "colocated"), now=1.0)
    (entry,) = [n for n in registry.report(1.0) if n["id"] == "tcp://x:1"]
    assert entry["healthy"] is False and "pd mode" in entry["problem"]


def test_a_dead_registered_node_is_forgotten_but_a_seed_is_kept():
    registry = NodeRegistry([P], [D], timeout=3.0, colocated=False, forget_after=10.0)
    other = "tcp://10.0.0.2:5601"
    for node_id, role in [(other, "prefill"), (P, "prefill")]:
        registry.observe(heartbeat(node_id, role), now=1.0)
    assert sorted(registry.sweep(5.0)) == sorted([other, P])
    assert registry.forget_stale(10.0) == []
    assert registry.forget_stale(11.5) == [other]
    assert set(registry.nodes) == {P, D}


def test_a_draining_node_keeps_its_requests_but_gets_no_new_ones():
    registry = pd_registry()
    registry.observe(heartbeat(P, "prefill", draining=True), now=1.0)
    assert registry.healthy("prefill", 1.0) == []
    assert registry.sweep(1.5) == []  # alive: its in-flight requests are not lost
    (entry,) = [n for n in registry.report(1.0) if n["id"] == P]
    assert entry["draining"] is True


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
        "draining": False,
        "load": {"free_blocks": 42, "running": 3, "waiting": 0, "queued_tokens": 0},
    }


def test_the_core_connects_to_a_node_that_registers_and_routes_to_it():
    link = LoopbackNodes()
    core = RouterCore(RouterConfig(), RouterMetrics(), link=link, clock=lambda: 10.0)
    for node, role in [("tcp://10.0.0.1:5601", "prefill"), ("tcp://10.0.0.2:5701", "decode")]:
        core.on_message(heartbeat(node, role))
    core.on_message(heartbeat("not-an-address", "prefill"))
    assert link.connected == ["tcp://10.0.0.1:5601", "tcp://10.0.0.2:5701", "not-an-address"]
    assert "not-an-address" not in core.registry.nodes  # no socket could reach it
    route = core.route([1, 2, 3])
    assert (route.prefill, route.decode) == ("tcp://10.0.0.1:5601", "tcp://10.0.0.2:5701")


def test_the_core_closes_the_line_to_a_forgotten_node():
    link = LoopbackNodes()
    clock = ManualClock(10.0)
    config = RouterConfig(forget_node_after_s=5.0)
    core = RouterCore(config, RouterMetrics(), link=link, clock=clock)
    core.on_message(heartbeat("tcp://10.0.0.1:5601", "prefill"))
    clock.now += 4.0
    assert core.sweep() == ["tcp://10.0.0.1:5601"]
    clock.now += 2.0
    core.sweep()
    assert link.disconnected == ["tcp://10.0.0.1:5601"]
    assert core.registry.nodes == {}


def stalled_core() -> tuple[RouterCore, ManualClock]:
    """A router whose reader caught up at t=1000 with fresh heartbeats from both nodes."""
    clock = ManualClock(1000.0)
    core = RouterCore(
        RouterConfig(prefill=[P], decode=[D]), RouterMetrics(), LoopbackNodes(), clock
    )
    core.on_message(heartbeat(P, "prefill"))
    core.on_message(heartbeat(D, "decode"))
    core.events_read()
    return core, clock


def test_a_stall_of_the_routers_own_loop_is_not_taken_for_silent_nodes():
    """4 s without reading events (a slow first import inside a request): the heartbeats sent
    meanwhile wait unread in the socket, so the nodes' silence is the router's own."""
    core, clock = stalled_core()
    in_flight = core.events.open("r1", [P, D])
    clock.now += 4.0
    assert core.route([1, 2, 3]).prefill == P
    assert core.sweep() == []
    core.on_message(heartbeat(P, "prefill"))  # the first ones read once the loop runs again
    core.on_message(heartbeat(D, "decode"))
    assert in_flight.empty(), "a NodeLost would fail the request"


def test_nodes_silent_once_the_reader_caught_up_are_dead():
    core, clock = stalled_core()
    clock.now += 4.0
    core.events_read()  # read everything: no heartbeat came
    assert core.sweep() == [P, D]
    with pytest.raises(OpenAIError, match="no healthy prefill node"):
        core.route([1, 2, 3])


def test_a_reader_that_never_catches_up_finds_dead_nodes_one_timeout_late():
    core, clock = stalled_core()
    clock.now += 5.9
    assert core.sweep() == []
    clock.now += 0.2  # two timeouts after the last heartbeat
    assert core.sweep() == [P, D]
