"""The decode node's real loop under a steady batch whose members finish and join while it runs.

A `DecodeNode` (PD mode, zmq transport) runs in this process; a thread stands in for the router
and the prefill node and drains what the node sends them. Requests enter exactly as after a KV
transfer: `DecodeNode.handle(DecodeRequest)` (parsing, validation, reservation queue), then
`ReservationQueue.reserve_next` (blocks) and `PDAdmission._transfer_ended` with a DONE transfer
(admission with the first token); only the KV bytes are not moved: the pool's random contents
stand in for them. Each request draws max_tokens in [lo, hi], so requests finish and are
replaced while the loop runs. A step is one `DecodeNode.step()`: inbox, receiver, schedule,
launch, resolve, outputs, TokenBatch encoding and send, load; the time per step is the wall
time of the measured steps over their number.
"""

from __future__ import annotations

import functools
import random
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from benchmarks.profiles import host_table, kernel_table
from common.engine.config import EngineConfig
from common.engine.worker import Worker
from common.node.config import NodeConfig
from common.protocol.messages import DecodeRequest
from common.protocol.sampling_params import SamplingParams
from decode_node import choices
from decode_node.node import DecodeNode
from kv_transfer import Transfer, TransferState


class Drain(threading.Thread):
    """PULL sockets for the router's events and the prefill node's inbox; counts frames."""

    def __init__(self, context: zmq.Context, addresses: list[str]) -> None:
        super().__init__(name="drain", daemon=True)
        self.sockets = []
        for address in addresses:
            sock = context.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(address)
            self.sockets.append(sock)
        self.frames = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in self.sockets:
            poller.register(sock, zmq.POLLIN)
        while not self._stop_event.is_set():
            for sock, _ in poller.poll(50):
                while True:
                    try:
                        sock.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.frames += 1

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=2)
        for sock in self.sockets:
            sock.close(linger=0)


def build_node(
    engine: EngineConfig, worker: Worker, base_port: int
) -> tuple[DecodeNode, Drain, str]:
    """The node (on an already loaded worker), its drain, and the address it takes for its
    prefill node (drained too)."""
    a = [f"tcp://127.0.0.1:{base_port + i}" for i in range(4)]
    node_config = NodeConfig(control_address=a[0], router_address=a[1], kv_address=a[2])
    node = DecodeNode(node_config, engine, worker)
    drain = Drain(node.channel.context, [a[1], a[3]])
    drain.start()
    return node, drain, a[3]


def greedy_params(rng: random.Random, lo: int, hi: int, i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=rng.randint(lo, hi), ignore_eos=True)


def mixed_params(rng: random.Random, lo: int, hi: int, i: int) -> SamplingParams:
    """Half greedy; half temperature + top-p + penalties + a seed."""
    if i % 2 == 0:
        return greedy_params(rng, lo, hi, i)
    return SamplingParams(
        temperature=0.8,
        top_p=0.9,
        repetition_penalty=1.1,
        frequency_penalty=0.2,
        presence_penalty=0.1,
        seed=i,
        max_tokens=rng.randint(lo, hi),
        ignore_eos=True,
    )


@dataclass
class LoopResult:
    batch: int
    steps: int
    step_s: float
    mean_context: float  # tokens in the KV of an average running request
    mean_running: float
    admitted: int
    profile: str | None = None


class LoopDriver:
    def __init__(self, node: DecodeNode, prefill: str, context: int, lo: int, hi: int) -> None:
        self.node, self.prefill, self.context, self.lo, self.hi = node, prefill, context, lo, hi
        self.params_fn = greedy_params
        self.rng = random.Random(0)
        self.admitted = 0
        vocab = node.worker.runtime.vocab_size
        self.prompt_pool = np.random.default_rng(0).integers(100, vocab - 100, 1 << 16)

    def admit(self) -> None:
        node, i = self.node, self.admitted
        rid = f"bench-{i}"
        start = self.rng.randrange(len(self.prompt_pool) - self.context)
        prompt = self.prompt_pool[start : start + self.context - 1].astype(np.int32)
        sampling = self.params_fn(self.rng, self.lo, self.hi, i)
        node.handle(DecodeRequest(rid, prompt, sampling, self.prefill))
        admission = node.admission  # PDAdmission; its receiver is bypassed
        request = admission.queue.reserve_next()
        assert request is not None, "KV pool too small for the benchmark batch"
        admission.num_reserved += 1  # as PDAdmission.poll counts a reservation
        done = Transfer(rid, request.block_ids, 0, time.monotonic() + 60)
        done.state, done.metadata = TransferState.DONE, {"first_token": int(prompt[0])}
        admission._transfer_ended(request, done)
        choices.fork(node.scheduler, request, request.seq)
        self.admitted += 1

    def top_up(self, batch: int) -> None:
        scheduler = self.node.scheduler  # admitted requests wait in `ready` until scheduled
        while len(scheduler.running) + len(scheduler.ready) < batch:
            self.admit()

    def step(self, batch: int) -> None:
        """One loop step, then admissions back up to `batch` running requests."""
        self.node.step()
        self.top_up(batch)

    def run(self, batch: int, steps: int, warmup: int, profile: bool = False) -> LoopResult:
        """`steps` timed loop steps after `warmup`; `profile`: cProfile the host side too."""
        node = self.node
        self.top_up(batch)
        for _ in range(warmup):
            self.step(batch)
        if node.worker.device.type == "cuda":
            torch.cuda.synchronize()
        admitted = self.admitted
        counted = {"running": 0, "contexts": 0}

        def measured() -> None:
            self.step(batch)
            # The next step's rows: the running set and the admissions it takes in.
            rows = [*node.scheduler.running, *node.scheduler.ready]
            counted["running"] += len(rows)
            counted["contexts"] += sum(s.num_tokens for s in rows)

        text = None
        start = time.perf_counter()
        if profile:
            text = host_table(measured, steps)
        else:
            for _ in range(steps):
                measured()
        if node.worker.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        running = counted["running"]
        return LoopResult(
            batch,
            steps,
            elapsed / steps,
            counted["contexts"] / max(1, running),
            running / steps,
            self.admitted - admitted,
            text,
        )

    def drain(self) -> None:
        """Finish every running request (between runs: a new batch size or parameter mix)."""
        for rid in list(self.node.requests):
            self.node._abort(rid)
        while self.node.core.has_work():
            self.node.step()

    def kernel_profile(self, batch: int, steps: int) -> str:
        """The device time per kernel over `steps` loop steps at `batch` (torch.profiler; not
        a timed run)."""

        self.top_up(batch)
        for _ in range(5):
            self.step(batch)
        return kernel_table(functools.partial(self.step, batch), steps)
