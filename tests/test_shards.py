"""scripts/run_tests.sh's split of the suite (tests/shards.py): every test file runs in exactly
one shard, the recorded times keep the shards within one file of each other, and merging a
shard's record keeps only files that exist."""

from __future__ import annotations

import json

import pytest

from tests import shards


def test_every_file_lands_in_exactly_one_shard_and_the_loads_are_within_one_file():
    files = shards.test_files()
    record = shards.recorded()
    for count in (1, 2, 3):
        parts = [shards.shard(files, i, count) for i in range(count)]
        assert sorted(f for part in parts for f in part) == files
        loads = [sum(shards.weight(f, record) for f in part) for part in parts]
        heaviest = max(shards.weight(f, record) for f in files)
        assert max(loads) - min(loads) <= heaviest


def test_an_unrecorded_file_weighs_by_size_and_stacks():
    assert shards.weight("tests/test_shards.py", {}) > 0
    assert shards.weight("tests/test_shards.py", {"tests/test_shards.py": {"wall_s": 3.5}}) == 3.5
    with pytest.raises(ValueError, match="shard index"):
        shards.shard(shards.test_files(), 2, 2)


def test_merge_takes_the_new_times_and_drops_files_that_are_gone(tmp_path, monkeypatch):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"tests/test_shards.py": {"wall_s": 1.0, "cpu_s": 1.0},
                               "tests/test_gone.py": {"wall_s": 9.0, "cpu_s": 9.0}}))  # fmt: skip
    monkeypatch.setattr(shards, "TIMES", old)
    run = tmp_path / "run"
    run.mkdir()
    (run / "1.json").write_text(json.dumps({"tests/test_shards.py": {"wall_s": 2.0, "cpu_s": 1.5}}))
    assert shards.merge(run) == {"tests/test_shards.py": {"wall_s": 2.0, "cpu_s": 1.5}}
