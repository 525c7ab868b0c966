"""The GGUF conversion cache under concurrency: a process that finds another converting the same
file waits on its lock and then loads that conversion instead of converting again (the nodes
of a stack start together; each conversion of the embedded model takes ~15 s)."""

from __future__ import annotations

import fcntl
import threading
import time
from pathlib import Path

from common.model import gguf_cache


def blocked_flock_waiters() -> int:
    return sum(
        "->" in line and "FLOCK" in line for line in Path("/proc/locks").read_text().splitlines()
    )


def test_a_second_converter_waits_for_the_first_and_converts_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF not really")  # never parsed: the conversion is already there
    target = gguf_cache.cached_hf_dir(gguf)
    target.parent.mkdir(parents=True, exist_ok=True)
    before = blocked_flock_waiters()
    result: list[Path] = []
    with open(target.parent / f".{target.name}.lock", "w") as lock:  # "the first converter"
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: result.append(gguf_cache.materialize_gguf(gguf)))
        waiter.start()
        deadline = time.monotonic() + 60  # a hang guard, not a speed bound
        while blocked_flock_waiters() == before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert blocked_flock_waiters() > before, "the second converter did not wait on the lock"
        target.mkdir()
        (target / "config.json").write_text("{}")  # the first converter's result lands
    waiter.join(timeout=60)
    assert result == [target]
    assert sorted(p.name for p in target.iterdir()) == ["config.json"]  # nothing converted again


def test_the_cache_is_keyed_by_contents_so_a_reinstalled_file_reuses_its_conversion(
    tmp_path, monkeypatch
):
    """Every new virtual environment installs the embedded GGUF at a new path: the conversion
    cached for the first must serve the second, and different bytes must not."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    first, second, other = (tmp_path / name / "model.gguf" for name in ("a", "b", "c"))
    for path, data in ((first, b"GGUF same"), (second, b"GGUF same"), (other, b"GGUF other")):
        path.parent.mkdir()
        path.write_bytes(data)
    assert gguf_cache.cached_hf_dir(first) == gguf_cache.cached_hf_dir(second)
    assert gguf_cache.cached_hf_dir(first) != gguf_cache.cached_hf_dir(other)
    assert gguf_cache.cached_hf_dir(first, "bfloat16").name.endswith("-bfloat16")
    # Each path's digest is remembered: one small file per (path, size, mtime), nothing more.
    digests = sorted((tmp_path / "cache" / "gguf" / ".digests").iterdir())
    assert len(digests) == 3
    assert {d.read_text() for d in digests} == {
        gguf_cache.content_digest(first),
        gguf_cache.content_digest(other),
    }
    other.write_bytes(b"GGUF changed")  # a new size: hashed again, not read from the memo
    assert gguf_cache.cached_hf_dir(other) != gguf_cache.cached_hf_dir(first)


def test_a_prebuilt_cache_is_read_first_and_never_written(tmp_path, monkeypatch):
    """The CPU image converts the embedded model at build time into PDSERVE_PREBUILT_CACHE_DIR;
    a container whose writable cache starts empty (a Kubernetes emptyDir) serves that copy."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF not really")  # never parsed: the conversion is already there
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "build"))
    built = gguf_cache.cached_hf_dir(gguf)  # where the image build put it (and its digest memo)
    built.mkdir()
    (built / "config.json").write_text("{}")
    monkeypatch.setenv("PDSERVE_PREBUILT_CACHE_DIR", str(tmp_path / "build"))
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "empty"))
    assert gguf_cache.materialize_gguf(gguf) == built
    assert not (tmp_path / "empty").exists()  # neither converted nor hashed again
