"""A short chaos soak (benchmarks/chaos_soak.py runs it long): Poisson load on 2 prefill and
2 decode nodes of the embedded model while nodes are SIGKILLed and restarted by the launcher.
Asserts outcomes only: every request ended with its full output or an OpenAI error, every node
came back holding no KV block, the stack served again, and no process was left behind."""

from __future__ import annotations

from benchmarks.chaos_soak import SoakConfig, run_soak


def test_nodes_killed_under_load_lose_no_request_silently_and_leak_nothing(tmp_path):
    config = SoakConfig(
        duration_s=12,  # 2 kills at these gaps; CI time is shared
        rate=1.0,
        kill_every_s=(4.0, 6.0),
        max_tokens=8,
        prompt_tokens=(8, 64),
        kv_blocks=128,  # 90 MiB pools instead of 1 GiB: four nodes on a shared machine
    )
    report = run_soak(config, tmp_path / "launch.log")
    print(report.summary())
    assert report.kills, "the soak killed no node"
    assert report.requests >= 5
    assert report.violations == []
    assert report.leaks == []
    assert report.orphans == []
    assert report.served_after
