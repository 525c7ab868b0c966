"""What a sweep watches on the stack it drives: CPU use per process and the KV blocks held.

CPU use is read from /proc (utime + stime of each process, over the wall time of a point), so
a router or node loop that saturates its core under load shows as ~100%. Held blocks are the
load figures each node reports in its heartbeat that must return to 0 once no request is in
flight (decode and colocated: used, reserved, quarantined; prefill: transfers in flight).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from benchmarks.stack import PDStack, descendants

HELD = {
    "decode": ("used_blocks", "reserved", "quarantined"),
    "colocated": ("used_blocks", "reserved", "quarantined"),
    "prefill": ("transferring",),
}
ROLES = {"router": "router", "prefill_node": "prefill", "decode_node": "decode"}


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def _cpu_ticks(pid: int, task: int | None = None) -> int | None:
    path = f"/proc/{pid}/stat" if task is None else f"/proc/{pid}/task/{task}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15 of stat)


def _thread_ticks(pid: int) -> dict[int, tuple[str, int]]:
    """Per thread of `pid`: (its name, CPU ticks so far)."""
    out = {}
    try:
        tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return out
    for tid in tasks:
        ticks = _cpu_ticks(pid, tid)
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        if ticks is not None:
            out[tid] = (name, ticks)
    return out


def stack_processes(stack: PDStack) -> dict[str, int]:
    """The stack's Python processes by name: router, prefill-<port>, decode-<port>."""
    out = {}
    for pid in descendants(stack.proc.pid):
        argv = _cmdline(pid)
        if "-m" not in argv:
            continue
        module = argv[argv.index("-m") + 1] if argv.index("-m") + 1 < len(argv) else ""
        role = ROLES.get(module)
        if role is None:
            continue
        name = role
        if "--control-address" in argv:
            name += "-" + argv[argv.index("--control-address") + 1].rsplit(":", 1)[-1]
        out[name] = pid
    return out


class StackProbe:
    def __init__(self, stack: PDStack) -> None:
        self.stack = stack
        self.procs = stack_processes(stack)
        self._ticks: dict[str, int | None] = {}
        self._threads: dict[str, dict[int, tuple[str, int]]] = {}
        self.threads: dict[str, dict[str, float]] = {}  # of the last start/stop window
        self._started = 0.0

    def start(self) -> None:
        self._ticks = {name: _cpu_ticks(pid) for name, pid in self.procs.items()}
        self._threads = {name: _thread_ticks(pid) for name, pid in self.procs.items()}
        self._started = time.monotonic()

    def stop(self) -> dict[str, float | None]:
        """CPU use of each process since `start`, in percent of one core."""
        wall = max(time.monotonic() - self._started, 1e-9)
        hz = os.sysconf("SC_CLK_TCK")
        out: dict[str, float | None] = {}
        for name, pid in self.procs.items():
            now, then = _cpu_ticks(pid), self._ticks.get(name)
            out[name] = None if now is None or then is None else 100 * (now - then) / hz / wall
        self.threads = {
            name: self._busy_threads(pid, name, hz, wall) for name, pid in self.procs.items()
        }
        return out

    def _busy_threads(self, pid: int, name: str, hz: int, wall: float) -> dict[str, float]:
        """CPU percent by thread name (threads of one name summed), those above 2% only."""
        before = self._threads.get(name, {})
        by_name: dict[str, float] = {}
        for tid, (comm, ticks) in _thread_ticks(pid).items():
            used = ticks - before.get(tid, (comm, 0))[1]
            by_name[comm] = by_name.get(comm, 0.0) + 100 * used / hz / wall
        return {k: round(v, 1) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1]) if v > 2}

    def held(self) -> dict[str, dict[str, int]]:
        nodes = self.stack.get("/health")[1]["nodes"]
        return {
            f"{n['role']} {n['id']}": {
                k: (n.get("load") or {}).get(k, -1) for k in HELD.get(n["role"], ())
            }
            for n in nodes
        }

    def wait_idle(self, timeout_s: float) -> dict[str, dict[str, int]]:
        """Poll until no node holds blocks (heartbeats refresh the figures every ~0.5 s);
        returns the last figures, all zero unless something leaked or is still draining."""
        deadline = time.monotonic() + timeout_s
        while True:
            held = self.held()
            if all(v == 0 for node in held.values() for v in node.values()):
                return held
            if time.monotonic() > deadline:
                return held
            time.sleep(0.25)
