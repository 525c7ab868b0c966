"""A node's run / drain / stop state (pure Python, a manual clock)."""

from __future__ import annotations

from common.node.lifecycle import SETTLE_S, Lifecycle
from tests.router_fakes import ManualClock


def test_a_running_node_never_exits_on_its_own():
    life = Lifecycle(drain_timeout_s=30, clock=ManualClock())
    assert not life.should_exit(idle=True) and not life.draining


def test_a_draining_node_exits_once_idle_after_the_router_could_see_the_flag():
    clock = ManualClock()
    life = Lifecycle(drain_timeout_s=30, clock=clock)
    life.drain()
    assert life.draining
    assert not life.should_exit(idle=True)  # too early: requests may still be on their way
    clock.now += SETTLE_S
    assert not life.should_exit(idle=False)  # in-flight requests finish first
    assert life.should_exit(idle=True)


def test_a_drain_that_takes_too_long_gives_up():
    clock = ManualClock()
    life = Lifecycle(drain_timeout_s=30, clock=clock)
    life.drain()
    clock.now += 30
    assert life.should_exit(idle=False)


def test_stop_or_a_second_drain_signal_exits_at_once():
    life = Lifecycle(drain_timeout_s=30, clock=ManualClock())
    life.stop()
    assert life.should_exit(idle=False)
    twice = Lifecycle(drain_timeout_s=30, clock=ManualClock())
    twice.drain()
    twice.drain()
    assert twice.should_exit(idle=False)
