"""Configuration shared by the node processes, and their command line (derived from fields)."""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass, field

from common.engine.config import EngineConfig, add_dataclass_args, engine_config_from_args
from common.protocol.wire_auth import require_secret_for


@dataclass(frozen=True)
class NodeConfig:
    control_address: str = field(
        default="tcp://127.0.0.1:5601",
        metadata={"help": "this node's control socket (also its id)"},
    )
    router_address: str = field(
        default="tcp://127.0.0.1:5600", metadata={"help": "the router's events socket"}
    )
    kv_address: str = field(
        default="tcp://127.0.0.1:5801", metadata={"help": "decode node: where KV arrives"}
    )
    transport: str = field(
        default="zmq",
        metadata={
            "help": "KV transport: zmq (any host), cuda_ipc (same host, falls back to zmq "
            "framing), nixl (NIXL WRITEs, any host; needs the nixl package); loopback is for "
            "in-process tests",
            "choices": ("zmq", "cuda_ipc", "nixl", "loopback"),
        },
    )
    ipc_stream_min_tokens: int = field(
        default=1024,
        metadata={
            "help": "cuda_ipc: a prefill step of fewer tokens ships each finished prompt's KV in "
            "one copy right after its first token instead of layer by layer (its compute is too "
            "short to hide per-layer sends); 0: always layer by layer"
        },
    )
    transfer_deadline_s: float = field(
        default=30.0, metadata={"help": "a KV transfer not done by then fails its request"}
    )
    fail_transfer_rate: float = field(
        default=0.0, metadata={"help": "tests only: fraction of transfers failed on purpose"}
    )
    kv_growth_headroom: float = field(
        default=0.1,
        metadata={
            "help": "decode node: fraction of the KV pool that new reservations leave free for "
            "running sequences to grow (out of blocks, it preempts and recomputes)"
        },
    )
    drain_timeout_s: float = field(
        default=60.0,
        metadata={
            "help": "after SIGTERM the node takes no new requests and exits once idle, or "
            "after this many seconds (SIGINT: at once)"
        },
    )
    colocated: bool = field(
        default=False, metadata={"help": "decode node: prefill locally too (no prefill node)"}
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.kv_growth_headroom < 1.0:
            raise ValueError(f"kv_growth_headroom must be in [0, 1), got {self.kv_growth_headroom}")
        if self.transport == "nixl" and importlib.util.find_spec("nixl") is None:
            raise ValueError(
                "--transport nixl needs the nixl package, which is not installed "
                "(pip install 'pdserve[nixl]')"
            )


def parse_node_args(
    description: str, argv: list[str] | None = None
) -> tuple[NodeConfig, EngineConfig]:
    parser = argparse.ArgumentParser(description=description)
    add_dataclass_args(parser, NodeConfig)
    add_dataclass_args(parser, EngineConfig)
    args = parser.parse_args(argv)
    try:
        node = NodeConfig(**{f: getattr(args, f) for f in NodeConfig.__dataclass_fields__})
        require_secret_for([node.control_address, node.kv_address])
    except ValueError as exc:
        parser.error(str(exc))
    return node, engine_config_from_args(args)
