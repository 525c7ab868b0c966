"""A node's control channel never blocks its loop on a peer that is gone or stuck."""

from __future__ import annotations

import zmq

from common.node.channel import PEER_SEND_HWM, NodeChannel
from common.protocol.messages import Abort, Heartbeat, decode


def test_messages_to_a_peer_that_reads_nothing_are_dropped_not_waited_for(tmp_path):
    channel = NodeChannel(f"ipc://{tmp_path}/node", f"ipc://{tmp_path}/router", "prefill")
    try:
        gone = f"ipc://{tmp_path}/gone-peer"  # nobody binds it: nothing is ever read
        sent = [channel.to_peer(gone, Abort(f"r{i}")) for i in range(3 * PEER_SEND_HWM)]
        assert all(sent[:PEER_SEND_HWM]), "the queue takes PEER_SEND_HWM messages"
        assert not sent[-1] and channel.undelivered_messages == sent.count(False) > 0
        assert channel.to_peer("not an address", Abort("r")) is False
    finally:
        channel.close()


def test_the_first_heartbeat_already_carries_the_nodes_load(tmp_path):
    """A router that sees a node before its loop published any figures would show it with an
    empty load (tests and the planner read `used_blocks` from it)."""
    router = zmq.Context.instance().socket(zmq.PULL)
    router.setsockopt(zmq.RCVTIMEO, 10_000)  # only a hang reaches it
    router.bind(f"ipc://{tmp_path}/router")
    channel = NodeChannel(f"ipc://{tmp_path}/node", f"ipc://{tmp_path}/router", "decode")
    try:
        channel.start_heartbeat({"pid": 1}, {"used_blocks": 0, "running": 0})
        first = decode(router.recv())
        assert isinstance(first, Heartbeat) and first.load == {"used_blocks": 0, "running": 0}
    finally:
        channel.close()
        router.close(linger=0)
