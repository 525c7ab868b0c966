"""PDSERVE_PROFILE_DIR: a node's main loop profiled and written out when it ends."""

from __future__ import annotations

import os

from common.node.profiling import profiled


def _busy_loop_for_the_profile() -> int:
    return sum(i * i for i in range(20_000))


def test_profiled_writes_the_profile_and_a_summary_naming_the_hot_function(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_PROFILE_DIR", str(tmp_path / "prof"))
    with profiled("prefill"):
        _busy_loop_for_the_profile()
    stem = tmp_path / "prof" / f"prefill-{os.getpid()}"
    assert stem.with_suffix(".prof").stat().st_size > 0
    assert "_busy_loop_for_the_profile" in stem.with_suffix(".txt").read_text()


def test_profiled_does_nothing_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_PROFILE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    with profiled("decode"):
        _busy_loop_for_the_profile()
    assert list(tmp_path.iterdir()) == []
