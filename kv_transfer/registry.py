"""Transport name -> (sender class, receiver class). Adding a transport is one entry here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kv_transfer.base import KVReceiver, KVSender, TransferConfig
from kv_transfer.cuda_ipc import CudaIpcReceiver, CudaIpcSender
from kv_transfer.loopback import LoopbackReceiver, LoopbackSender
from kv_transfer.nixl_transport import NixlReceiver, NixlSender
from kv_transfer.zmq_transport import ZmqReceiver, ZmqSender

if TYPE_CHECKING:
    import torch

TRANSPORTS: dict[str, tuple[type[KVSender], type[KVReceiver]]] = {
    "zmq": (ZmqSender, ZmqReceiver),
    "loopback": (LoopbackSender, LoopbackReceiver),
    "cuda_ipc": (CudaIpcSender, CudaIpcReceiver),
    "nixl": (NixlSender, NixlReceiver),  # needs the optional nixl package
}


def _transport(name: str) -> tuple[type[KVSender], type[KVReceiver]]:
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(
            f"unknown KV transport {name!r}; known transports: {', '.join(sorted(TRANSPORTS))}"
        ) from None


def create_sender(config: TransferConfig, pool: torch.Tensor) -> KVSender:
    return _transport(config.transport)[0](pool, config)


def create_receiver(config: TransferConfig, pool: torch.Tensor, bind_address: str) -> KVReceiver:
    return _transport(config.transport)[1](pool, config, bind_address)
