"""The processes of a tensor- or pipeline-parallel node: rank 0 is the node itself, ranks
1..pp*tp-1 (every stage's tensor-parallel ranks) are children it starts (`multiprocessing`
spawn), watches and stops.

Lifetimes are tied both ways: a rank that exits while the node runs takes the node down
(`RANK_DIED`: its collectives could never complete again), and a rank whose parent is gone
exits at once. On a normal stop rank 0 broadcasts STOP, joins its ranks, terminates the rest.
A rank's life is `rank_main`: build the same `Worker` in lockstep with rank 0, then follow
its steps until STOP.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from common import envs
from common.engine.config import EngineConfig

if TYPE_CHECKING:
    import torch

    from common.engine.worker import Worker

log = logging.getLogger(__name__)

RANK_DIED = 70
WATCH_INTERVAL_S = 0.2
JOIN_TIMEOUT_S = 10.0


class RankHandler(Protocol):
    """What a rank > 0 does with rank 0's commands between steps, and the per-layer hook of a
    step rank 0 runs with one (the KV transfer of a node's role: `kv_transfer.tp`)."""

    def command(self, command: dict[str, Any], payload: torch.Tensor | None) -> None: ...
    def layer_hook(self, flags: int) -> Callable[[int], None] | None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class RankRole:
    """How a rank > 0 of this node builds its handler once its `Worker` is up; None: it has
    none (colocated, offline). The role's package injects it, so the engine imports no
    transport; it travels to the spawned rank, so it must pickle (a module-level function or
    a `functools.partial` of one)."""

    make_handler: Callable[[Worker], RankHandler] | None = None


def free_tcp_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def rank_name(rank: int, tp: int, pp: int) -> str:
    if pp == 1:
        return f"tp-rank-{rank}"
    return f"pp-stage-{rank // tp}-tp-rank-{rank % tp}"


class RankProcesses:
    """Ranks 1..pp*tp-1 of the node whose rank 0 runs in this process."""

    def __init__(self, config: EngineConfig, role: RankRole) -> None:
        self.init_method = free_tcp_address()
        self._stopping = False
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(
                target=rank_main,
                args=(config, role, rank, self.init_method, os.getpid()),
                name=rank_name(rank, config.tp, config.pp),
                daemon=True,  # multiprocessing terminates daemons when this process exits
            )
            for rank in range(1, config.world_size)
        ]
        for proc in self.procs:
            proc.start()
        log.info("started ranks %s", {p.name: p.pid for p in self.procs})
        # A process that exits without `Worker.close()` kills its ranks (they ignore SIGTERM,
        # which multiprocessing's own exit handler would send, and wait in a collective).
        atexit.register(self.terminate)
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopping:
            for proc in self.procs:
                if proc.exitcode is not None and not self._stopping:
                    log.error(
                        "rank %s (pid %d) exited with %s: stopping the node",
                        proc.name, proc.pid, proc.exitcode,
                    )  # fmt: skip
                    self.terminate()
                    os._exit(RANK_DIED)  # the main thread may wait in a collective forever
            time.sleep(WATCH_INTERVAL_S)

    def stop(self) -> None:
        """After rank 0 broadcast STOP: wait for the ranks, then terminate stragglers."""
        self._stopping = True
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.terminate()

    def terminate(self) -> None:
        self._stopping = True
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(JOIN_TIMEOUT_S)


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(RANK_DIED)
        time.sleep(WATCH_INTERVAL_S)


def rank_main(
    config: EngineConfig, role: RankRole, rank: int, init_method: str, parent_pid: int
) -> None:
    # Ctrl-C reaches the whole process group, SIGTERM drains a node (its ranks keep serving
    # the drain): rank 0 decides when its ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    envs.setup_logging(rank_name(rank, config.tp, config.pp))
    if "OMP_NUM_THREADS" not in os.environ:  # CPU ranks share the cores (the launcher sets it)
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.world_size))
    from common.engine.worker import Worker

    worker = Worker(config, role, rank, init_method)
    handler = role.make_handler(worker) if role.make_handler is not None else None
    try:
        worker.follow(handler)
    finally:
        if handler is not None:
            handler.close()
        worker.close()
