"""Run, drain and stop of a node process, driven by signals (pure Python apart from `signal`).

SIGTERM drains: the node reports `draining` in its heartbeat load, so the router sends it no new
requests, and it keeps serving what it holds (requests the router dispatched before it saw the
flag included). It exits once it is idle and the router has had time to see the flag, or when
`drain_timeout_s` runs out. SIGINT, or a second SIGTERM, stops it at once.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable

from common.node.channel import HEARTBEAT_INTERVAL_S

log = logging.getLogger(__name__)

SETTLE_S = 3 * HEARTBEAT_INTERVAL_S  # a draining node lives at least this long: the router
# must see the flag in a heartbeat, and requests it sent before that must arrive


class Lifecycle:
    def __init__(self, drain_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        if drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {drain_timeout_s}")
        self.drain_timeout_s = drain_timeout_s
        self.clock = clock
        self.stopping = False
        self.drain_started: float | None = None

    @property
    def draining(self) -> bool:
        return self.drain_started is not None

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.drain())
        signal.signal(signal.SIGINT, lambda *_: self.stop())

    def drain(self) -> None:
        if self.draining:
            self.stop()
            return
        self.drain_started = self.clock()
        log.info(
            "draining: no new requests; exiting once idle (at most %.0f s)", self.drain_timeout_s
        )

    def stop(self) -> None:
        self.stopping = True

    def should_exit(self, idle: bool) -> bool:
        if self.stopping:
            return True
        if self.drain_started is None:
            return False
        elapsed = self.clock() - self.drain_started
        if elapsed >= self.drain_timeout_s:
            log.warning("drain timeout (%.0f s): exiting with requests in flight", elapsed)
            return True
        return idle and elapsed >= SETTLE_S
