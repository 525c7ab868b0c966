"""KV transfer: moves a request's KV blocks from a prefill pool into a decode pool.

Lifecycle of one request (each side tracks a `Transfer`: PENDING -> IN_FLIGHT -> DONE, or
FAILED from PENDING / IN_FLIGHT):
  1. decode: reserve blocks, `receiver.expect(request_id, block_ids)`, then send the reservation
     (its `receiver.address` and the block ids) to the prefill node.
  2. prefill: `sender.begin(request_id, address, src_blocks, dst_blocks)`, then
     `send_layer(request_id, layer)` once per layer as each layer's KV is final (any order), then
     `complete(request_id, metadata)` with msgpack-able metadata (first token, timing).
  3. both: `poll()` each loop iteration returns transfers that turned terminal since the last
     poll; DONE on the receiver carries the sender's metadata. A failure (abort, deadline,
     malformed frame, injected failure) ends that one transfer, never the loop.
Ownership: the prefill node keeps its source blocks until its sender reports the transfer
terminal (or `abort()` returned), then frees them. The decode node frees its reserved blocks
when its receiver reports FAILED or after `cancel()`; on DONE they belong to the request.

A pool is `[num_layers, planes, num_blocks, block_size, heads, head_dim]`: K and V (planes 2)
or MLA's one latent plane (planes 1); every transport moves whole blocks of every plane as
bytes (kv_transfer.pool_io).

Transports (`TRANSPORTS`): "zmq" (across hosts), "cuda_ipc" (one host, straight into the decode
GPU's pool), "nixl" (NIXL WRITEs, any host) and "loopback" (in-process, tests). The state
machine, frames and ledgers import no torch; the transports are loaded on first use.
"""

from typing import TYPE_CHECKING

from kv_transfer.base import KVReceiver, KVSender, Transfer, TransferConfig, TransferState

__all__ = [
    "KVReceiver",
    "KVSender",
    "TRANSPORTS",
    "Transfer",
    "TransferConfig",
    "TransferState",
    "create_receiver",
    "create_sender",
]

if TYPE_CHECKING:
    from kv_transfer.registry import TRANSPORTS, create_receiver, create_sender


def __getattr__(name: str):
    if name in ("TRANSPORTS", "create_receiver", "create_sender"):
        from kv_transfer import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
