"""Two "hosts" on one machine: two network namespaces joined by a veth pair.

`HostPair.create()` makes them (it needs root and a kernel that allows it; `NetnsUnavailable`
says why not, from the real failure), `run_in` starts a process inside one, and `destroy()`
kills every process still inside a namespace and deletes both (idempotent, never raises), so
a test's teardown leaves nothing behind even when the test failed halfway.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

PREFIX_LEN = 24


class NetnsUnavailable(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result


@dataclass
class HostPair:
    """Namespaces `names[i]` with address `addresses[i]` on their end of one veth pair."""

    tag: str  # short and unique: interface names are at most 15 characters
    addresses: tuple[str, str] = ("10.77.0.1", "10.77.0.2")
    names: tuple[str, str] = field(init=False)
    _made: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.names = (f"pdserve-{self.tag}-a", f"pdserve-{self.tag}-b")

    def create(self) -> HostPair:
        if shutil.which("ip") is None:
            raise NetnsUnavailable("no `ip` command (iproute2)")
        if os.geteuid() != 0:
            raise NetnsUnavailable(f"not root (euid {os.geteuid()})")
        try:
            for name in self.names:
                _ip("netns", "add", name)
                self._made.append(name)
                _ip("-n", name, "link", "set", "lo", "up")
            ends = (f"pv{self.tag}a", f"pv{self.tag}b")
            _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
            for name, end, address in zip(self.names, ends, self.addresses, strict=True):
                _ip("link", "set", end, "netns", name)
                _ip("-n", name, "addr", "add", f"{address}/{PREFIX_LEN}", "dev", end)
                _ip("-n", name, "link", "set", end, "up")
        except NetnsUnavailable:
            _ip("link", "del", f"pv{self.tag}a", check=False)  # if it never moved
            self.destroy()
            raise
        return self

    def run_in(self, host: int, argv: list[str], **popen_kw) -> subprocess.Popen:
        """Start `argv` inside namespace `host` (0 or 1) in a session of its own.

        `ip netns exec` execs the command, so the returned pid is the command's own."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.names[host], *argv], start_new_session=True, **popen_kw
        )

    def pids(self, host: int) -> list[int]:
        out = _ip("netns", "pids", self.names[host], check=False).stdout
        return [int(p) for p in out.split()]

    def destroy(self) -> list[int]:
        """SIGKILL whatever still runs inside the namespaces, then delete them; returns the
        pids that had to be killed (an empty list after a clean shutdown)."""
        killed = []
        for host, name in enumerate(self.names):
            if name not in self._made:
                continue
            for pid in self.pids(host):
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while self.pids(host) and time.monotonic() < deadline:
                time.sleep(0.1)
            _ip("netns", "del", name, check=False)  # the veth pair goes with it
        self._made.clear()
        return killed
