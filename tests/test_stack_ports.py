"""A test stack whose ports were taken between the check and the bind starts again elsewhere.

Shards start stacks side by side; a port checked free can be bound by another stack before
this one's nodes have loaded their weights. The loser exits naming the port, and PDStack starts
it again on other ports rather than failing the test that wanted a stack."""

from __future__ import annotations

import socket

import benchmarks.stack as stack_module
from tests.pd_stack import PDStack, pick_ports


def test_a_stack_given_a_taken_port_starts_again_on_other_ports(tmp_path, monkeypatch):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken_base = holder.getsockname()[1] - 1  # prefill-0's control port is base + 1
        picks = iter([(pick_ports()[0], taken_base)])
        monkeypatch.setattr(stack_module, "pick_ports", lambda: next(picks, None) or pick_ports())
        s = PDStack("--decode-num-kv-blocks", "64", log_path=tmp_path / "stack.log")
        try:
            assert s.base != taken_base
            status, body = s.get("/health")
            assert status == 200 and {n["role"] for n in body["nodes"]} == {"prefill", "decode"}
        finally:
            assert s.stop() == []
