"""How scripts/run_tests.sh splits the suite into shards, and the test-time record that guides it.

Whole test files go to shards, so module fixtures (a stack of processes, a model) are built
once. Each file weighs its recorded seconds from `tests/test_times.json`; a file not recorded
yet weighs an estimate from its size and the stacks it starts. The heaviest go first to the
lightest shard (longest-processing-time first), which leaves the shards within one file of
each other.

    python -m tests.shards I N          the files of shard I of N, one per line
    python -m tests.shards --merge DIR  fold the per-shard records DIR/*.json (written by the
                                        conftest when PDSERVE_TEST_TIMES_DIR is set) into
                                        tests/test_times.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMES = ROOT / "tests" / "test_times.json"
# An unrecorded file's estimate: seconds per byte of test code, and per stack it starts (a
# launcher, a router and two nodes: ~8 s on 2 shared cores).
SECONDS_PER_BYTE = 1 / 2500
SECONDS_PER_STACK = 8.0


def test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py"))


def recorded() -> dict[str, dict[str, float]]:
    return json.loads(TIMES.read_text()) if TIMES.exists() else {}


def weight(path: str, record: dict[str, dict[str, float]]) -> float:
    if path in record:
        return record[path]["wall_s"]
    text = (ROOT / path).read_text()
    return len(text) * SECONDS_PER_BYTE + SECONDS_PER_STACK * text.count("PDStack(")


def shard(files: list[str], index: int, count: int) -> list[str]:
    if not 0 <= index < count:
        raise ValueError(f"shard index must be in [0, {count}), got {index}")
    record = recorded()
    loads = [0.0] * count
    owned: list[list[str]] = [[] for _ in range(count)]
    for path in sorted(files, key=lambda p: (-weight(p, record), p)):
        lightest = loads.index(min(loads))
        owned[lightest].append(path)
        loads[lightest] += weight(path, record)
    return sorted(owned[index])


def merge(directory: Path) -> dict[str, dict[str, float]]:
    """The record with every file of DIR's shard records replaced by its new times; files
    no longer in tests/ are dropped."""
    record = recorded()
    for part in sorted(directory.glob("*.json")):
        record.update(json.loads(part.read_text()))
    present = set(test_files())
    return {path: record[path] for path in sorted(record) if path in present}


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--merge":
        record = merge(Path(argv[1]))
        TIMES.write_text(json.dumps(record, indent=1) + "\n")
        total = sum(times["wall_s"] for times in record.values())
        print(f"{TIMES.relative_to(ROOT)}: {len(record)} files, {total:.0f} s in all")
        return 0
    if len(argv) == 2:
        print("\n".join(shard(test_files(), int(argv[0]), int(argv[1]))))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
