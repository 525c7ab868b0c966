"""Summarize a `py-spy record --format raw` profile: the share of one thread's samples spent
inside (inclusive) each Python function, most first.

    python benchmarks/pyspy_summary.py pyspy_3p1d.txt --thread-frame DecodeNode.run --top 25
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

FRAME = re.compile(r"^(?P<func>[\w.<>]+) \((?P<file>[^:)]+\.py):\d+\)$")


def summarize(path: str, thread_frame: str) -> tuple[int, Counter[str]]:
    total, inclusive = 0, Counter()
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            if not any(thread_frame in frame for frame in frames):
                continue  # another thread
            total += int(count)
            seen = set()
            for frame in frames:
                match = FRAME.match(frame.strip())
                if match:
                    name = f"{match['func']} ({match['file'].rsplit('/', 2)[-1]})"
                    if name not in seen:
                        seen.add(name)
                        inclusive[name] += int(count)
    return total, inclusive


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("profile")
    ap.add_argument("--thread-frame", default="DecodeNode.run", help="a frame only that thread has")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    total, inclusive = summarize(args.profile, args.thread_frame)
    print(f"{total} samples of the thread running {args.thread_frame}")
    for name, n in inclusive.most_common(args.top):
        print(f"{100 * n / max(total, 1):6.1f}%  {name}")


if __name__ == "__main__":
    main()
