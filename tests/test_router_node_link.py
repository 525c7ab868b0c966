"""The router's ZMQ link over ipc sockets: events in, control messages out, bad frames dropped."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from common.protocol.messages import Abort, Heartbeat, decode, encode
from router.node_link import SendError, ZmqNodeLink
from tests.router_fakes import heartbeat


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.001)


def test_link_reads_events_skips_garbage_and_sends_controls(tmp_path):
    events, control = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/prefill"

    async def scenario() -> tuple[list, object]:
        ctx = zmq.asyncio.Context()
        inbox = ctx.socket(zmq.PULL)
        inbox.bind(control)
        link = ZmqNodeLink(events, [control])
        received: list = []
        reader = asyncio.create_task(link.run(received.append))
        node = ctx.socket(zmq.PUSH)
        node.connect(events)
        try:
            await node.send(b"\x93not a message")
            await node.send(encode(heartbeat(control, "prefill")))
            link.send(control, Abort("r1"))
            frame = await asyncio.wait_for(inbox.recv(), timeout=10)
            await asyncio.wait_for(until(lambda: received), timeout=10)
        finally:
            reader.cancel()
            for sock in (inbox, node):
                sock.close(linger=0)
            link.close()
            ctx.term()
        return received, decode(frame)

    received, sent = asyncio.run(scenario())
    assert sent == Abort("r1")
    assert len(received) == 1 and isinstance(received[0], Heartbeat)


def test_sending_to_a_node_not_on_the_command_line_fails(tmp_path):
    link = ZmqNodeLink(f"ipc://{tmp_path}/events", [])
    try:
        with pytest.raises(SendError, match="no control socket"):
            link.send("tcp://127.0.0.1:1", Abort("r"))
    finally:
        link.close()


def test_the_reader_handles_every_event_and_repeats_that_it_caught_up_while_idle(tmp_path):
    """What RouterCore.liveness_now relies on: "caught up" is said between events only when
    none is waiting, and an idle reader keeps saying it."""
    events = f"ipc://{tmp_path}/events"

    async def scenario() -> list:
        ctx = zmq.asyncio.Context()
        link = ZmqNodeLink(events, [])
        log: list = []
        reader = asyncio.create_task(link.run(log.append, lambda: log.append("caught up")))
        node = ctx.socket(zmq.PUSH)
        node.connect(events)
        try:
            for i in range(50):
                await node.send(encode(heartbeat(f"tcp://127.0.0.1:{6000 + i}", "prefill")))
            done = lambda: len(log) - log.count("caught up") == 50 and log[-3:] == ["caught up"] * 3  # noqa: E731
            await asyncio.wait_for(until(done), timeout=10)
        finally:
            reader.cancel()
            node.close(linger=0)
            link.close()
            ctx.term()
        return log

    log = asyncio.run(scenario())
    heartbeats = [m for m in log if m != "caught up"]
    assert all(isinstance(m, Heartbeat) for m in heartbeats) and len(heartbeats) == 50
