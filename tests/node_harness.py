"""Real prefill and decode nodes in the test's process, with the sockets of their peers.

A node runs on a tiny random Qwen2 (CPU, eager); the test plays its peers with real sockets:
the router (a PULL socket for the node's events), the other node (a PULL socket for its
control messages) and, for a prefill node, the decode node's KV receiver (a real
`ZmqReceiver` on a pool shaped like the node's). Tests drive a node by `handle` and `step`.
`NodePair` runs both nodes (or one colocated decode node) on any saved model, the test being
the router.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import torch
import zmq
from transformers import AutoModelForCausalLM, Qwen2Config

from common.engine.config import CacheConfig, EngineConfig, ModelConfig
from common.node.config import NodeConfig
from common.protocol.messages import (
    DecodeRequest,
    FirstToken,
    PrefillRequest,
    RequestError,
    Reservation,
    TokenBatch,
    decode,
)
from common.protocol.sampling_params import SamplingParams
from decode_node.node import DecodeNode
from decode_node.request import Phase
from kv_transfer import Transfer, TransferConfig, TransferState, create_receiver
from prefill_node.node import PrefillNode
from tests.tiny_models import TINY_SHAPE

MAX_STEPS = 2000  # node steps; only a hang reaches it
RECEIVE_TIMEOUT_MS = 10_000  # only a hang reaches it
BLOCK_SIZE = 16  # CacheConfig's default
FOREVER_S = 365 * 86400.0
_ports = itertools.count(0)


def save_tiny_model(folder: Path) -> str:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, max_position_embeddings=256, **TINY_SHAPE)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return str(folder)


def engine_config(model_dir: str) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model_dir, device="cpu", dtype="float32"),
        cache=CacheConfig(num_kv_blocks=32),
        enforce_eager=True,
    )


def pull(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, RECEIVE_TIMEOUT_MS)
    sock.bind(address)
    return sock


class PrefillHarness:
    """A prefill node plus the sockets of the router and the decode node it talks to."""

    def __init__(self, model_dir: str, tmp_path) -> None:
        n = next(_ports)
        router_address = f"ipc://{tmp_path}/router-{n}"
        self.decode_address = f"ipc://{tmp_path}/decode-{n}"
        self.router = pull(router_address)
        self.decode = pull(self.decode_address)
        config = NodeConfig(
            control_address=f"ipc://{tmp_path}/prefill-{n}",
            router_address=router_address,
            transport="zmq",
        )
        self.node = PrefillNode(config, engine_config(model_dir))
        pool = torch.zeros(self.node.worker.kv_cache.pool.shape)
        self.receiver = create_receiver(TransferConfig(transport="zmq"), pool, "tcp://127.0.0.1:0")

    def request(self, request_id: str, num_blocks: int) -> PrefillRequest:
        """The router's request for a prompt of `num_blocks` blocks (the last one partial)."""
        prompt = list(range(10, 10 + (num_blocks - 1) * BLOCK_SIZE + 5))
        sampling = SamplingParams(max_tokens=4, temperature=0)
        return PrefillRequest(
            request_id, prompt, sampling, self.decode_address, self.receiver.address
        )

    def reservation(self, request_id: str, block_ids: list[int]) -> Reservation:
        return Reservation(request_id, self.decode_address, block_ids)

    def step_until_idle(self) -> None:
        for _ in range(MAX_STEPS):
            if not self.node.jobs:
                return
            self.node.step()
        raise AssertionError(f"still held: {list(self.node.jobs)}")

    def transfers(self, count: int) -> dict[str, Transfer]:
        """The next `count` transfers the KV receiver saw end, by request id."""
        ended: dict[str, Transfer] = {}
        for _ in range(MAX_STEPS):
            if len(ended) == count:
                return ended
            ended.update((t.request_id, t) for t in self.receiver.poll(timeout_s=0.01))
        raise AssertionError(f"only {list(ended)} of {count} transfers ended")

    def serves(self, request_id: str) -> None:
        """A well-formed request goes through: first token out, its KV in the reserved blocks."""
        self.receiver.expect(request_id, [7, 8])
        self.node.handle(self.request(request_id, num_blocks=2))
        self.node.handle(self.reservation(request_id, [7, 8]))
        self.step_until_idle()
        first = decode(self.router.recv())
        assert isinstance(first, FirstToken) and first.request_id == request_id, first
        assert self.transfers(1)[request_id].state is TransferState.DONE

    def blocks_used(self) -> int:
        return self.node.worker.allocator.stats().num_used

    def close(self) -> None:
        self.node.sender.close()
        self.node.channel.close()
        self.node.worker.close()
        self.receiver.close()
        self.router.close(linger=0)
        self.decode.close(linger=0)


class DecodeHarness:
    """A decode node plus the sockets of the router and the prefill node it talks to."""

    def __init__(
        self,
        model_dir: str,
        tmp_path,
        transport: str,
        colocated: bool = False,
        transfer_deadline_s: float = 30.0,
    ) -> None:
        n = next(_ports)
        router_address = f"ipc://{tmp_path}/router-d{n}"
        self.prefill_address = f"ipc://{tmp_path}/prefill-d{n}"
        self.router = pull(router_address)
        self.prefill = pull(self.prefill_address)
        config = NodeConfig(
            control_address=f"ipc://{tmp_path}/decode-d{n}",
            router_address=router_address,
            kv_address="tcp://127.0.0.1:0",
            transport=transport,
            colocated=colocated,
            transfer_deadline_s=transfer_deadline_s,
        )
        self.node = DecodeNode(config, engine_config(model_dir))

    def request(self, request_id: str, prefill_node: str | None = None) -> DecodeRequest:
        """The router's request for a 40-token prompt (3 blocks) prefilled by `prefill_node`
        (default: the test's socket; colocated: none)."""
        prompt, sampling = list(range(10, 50)), SamplingParams(max_tokens=4)
        if self.node.config.colocated:
            return DecodeRequest(request_id, prompt, sampling, None)
        return DecodeRequest(request_id, prompt, sampling, prefill_node or self.prefill_address)

    def reserves(self, request_id: str) -> Reservation:
        """A well-formed request gets its blocks and the prefill node its Reservation."""
        self.node.handle(self.request(request_id))
        self.node.step()
        reservation = decode(self.prefill.recv())
        assert isinstance(reservation, Reservation) and reservation.request_id == request_id
        return reservation

    def blocks_used(self) -> int:
        return self.node.worker.allocator.stats().num_used

    def quarantined(self) -> list[str]:
        return [r.id for r in self.node.requests.values() if r.phase is Phase.QUARANTINED]

    def close(self) -> None:
        self.node.close()
        self.node.channel.close()
        self.router.close(linger=0)
        self.prefill.close(linger=0)


def node_config(tmp_path, name: str, router: str, **fields) -> NodeConfig:
    return NodeConfig(control_address=f"ipc://{tmp_path}/{name}", router_address=router, **fields)


def drain(sock: zmq.Socket) -> list:
    """Every message waiting on `sock` now, decoded, in order; [] when none."""
    out = []
    while True:
        try:
            out.append(decode(sock.recv(zmq.NOBLOCK)))
        except zmq.Again:
            return out


class NodePair:
    """A decode node (colocated, or paired with a prefill node over zmq) in this process, on
    the model in `folder`; the test is the router: it sends the requests, each with `params`,
    and reads the tokens from a real PULL socket."""

    def __init__(
        self, folder: str, tmp_path, params: SamplingParams, colocated: bool = False,
        decode_tp: int = 1,
    ):  # fmt: skip
        self.params = params
        mode = "colocated" if colocated else "pd"
        router = f"ipc://{tmp_path}/router-{mode}"
        self.router = pull(router)
        self.decode = DecodeNode(
            node_config(tmp_path, f"decode-{mode}", router, kv_address="tcp://127.0.0.1:0",
                        colocated=colocated),
            dataclasses.replace(engine_config(folder), tp=decode_tp),
        )  # fmt: skip
        self.prefill: PrefillNode | None = None
        if not colocated:
            prefill_config = node_config(tmp_path, f"prefill-{mode}", router)
            self.prefill = PrefillNode(prefill_config, engine_config(folder))

    def generate(self, request_id: str, prompt: list[int]) -> list[int]:
        """The request's tokens, the prefill node's first one included. The two nodes push to
        the router on separate pipes, so the first token may come after decode rows."""
        nodes = [self.decode] if self.prefill is None else [self.decode, self.prefill]
        prefill_id = None if self.prefill is None else self.prefill.channel.node_id
        self.decode.handle(DecodeRequest(request_id, prompt, self.params, prefill_id))
        if self.prefill is not None:
            kv_address = self.decode.admission.receiver.address
            message = PrefillRequest(
                request_id, prompt, self.params, self.decode.channel.node_id, kv_address
            )
            self.prefill.handle(message)
        first: list[int] = []
        rows: list[int] = []
        finished = False
        for _ in range(MAX_STEPS):
            for node in nodes:
                node.step()
            for message in drain(self.router):
                assert not isinstance(message, RequestError), message
                if isinstance(message, FirstToken):
                    first.append(message.token_id)
                elif isinstance(message, TokenBatch):
                    mine = [i for i, r in enumerate(message.request_ids) if r == request_id]
                    rows += [int(message.token_ids[i]) for i in mine]
                    finished |= any(message.finish_reasons[i] for i in mine)
            if finished and len(first) == len(nodes) - 1:
                return first + rows
        raise AssertionError(f"{request_id} did not finish: {first} + {rows}")

    def close(self) -> None:
        close_nodes(self.decode, self.prefill, self.router)


def close_nodes(decode, prefill, router) -> None:
    """Close a decode node, its prefill node (None when colocated) and the test's router
    socket."""
    for node in (decode, prefill):
        if node is not None:
            node.close()
            node.channel.close()
    router.close(linger=0)


def colocated_tokens(folder: str, tmp_path, params: SamplingParams,
                     prompts: list[list[int]]) -> list[list[int]]:  # fmt: skip
    """Each prompt's tokens from a colocated node on `folder`: the PD tests' baseline."""
    node = NodePair(folder, tmp_path, params, colocated=True)
    try:
        return [node.generate(f"c{i}", p) for i, p in enumerate(prompts)]
    finally:
        node.close()
