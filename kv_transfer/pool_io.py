"""One layer of a set of blocks, out of and into a KV pool, for any cache geometry.

The pool is `[num_layers, planes, num_blocks, block_size, heads, head_dim]`: planes 2 holds K
and V of the KV heads, planes 1 MLA's latent (one head of kv_lora_rank + rope values, the
same on every tensor-parallel rank). A layer payload is `pool[layer][:, block_ids]`, shape
`[planes, n, block_size, heads, head_dim]`, contiguous, whole blocks (a block's unused slots
travel too). Device-agnostic: on CUDA the gather runs on the GPU and the host copy is
asynchronous (HostStager); the write side copies host to device before scattering. KV moves as
bytes: a float8 pool is indexed through a uint8 view (index_copy_ has no float8 kernels), so an
FP8 pool's KV arrives bit for bit.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import torch

from kv_transfer.base import TransferConfig
from kv_transfer.frames import LayerHeader
from kv_transfer.ledger import ReceiverLedger, SenderLedger

log = logging.getLogger(__name__)


def check_pool(pool: torch.Tensor) -> None:
    """ValueError unless `pool` is `[num_layers, planes (1 or 2), num_blocks, block_size, heads,
    head_dim]`."""
    if pool.dim() != 6 or pool.shape[1] not in (1, 2) or min(pool.shape) < 1:
        raise ValueError(
            f"a KV pool is [num_layers, planes (1 or 2), num_blocks, block_size, heads, "
            f"head_dim], got {list(pool.shape)}"
        )


def block_bytes(pool: torch.Tensor) -> int:
    """Bytes of one block of one layer, every plane and every head the pool holds."""
    return pool.shape[1] * math.prod(pool.shape[3:]) * pool.element_size()


def sender_ledger(config: TransferConfig, pool: torch.Tensor) -> SenderLedger:
    check_pool(pool)
    return SenderLedger(config, pool.shape[0], pool.shape[2], block_bytes(pool))


def receiver_ledger(config: TransferConfig, pool: torch.Tensor) -> ReceiverLedger:
    check_pool(pool)
    return ReceiverLedger(config, pool.shape[0], pool.shape[2], pool.shape[4], block_bytes(pool))


def layer_shape(pool: torch.Tensor, num_blocks: int) -> list[int]:
    return [pool.shape[1], num_blocks, *pool.shape[3:]]


def _index(pool: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.long, device=pool.device)


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """A one-byte dtype (float8) as uint8, same shape and memory; any other as it is."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


def upload_ids(ids: list[int], device: torch.device, stream: torch.cuda.Stream) -> torch.Tensor:
    """Block ids as a device tensor, enqueued on `stream`. `torch.tensor(ids, device=cuda)`
    would be a pageable, blocking copy: it would wait for the compute the side stream waits
    on. Pinned + non_blocking does not."""
    host = torch.tensor(ids, dtype=torch.long).pin_memory()
    with torch.cuda.stream(stream):
        return host.to(device, non_blocking=True)


def gather_layer(
    pool: torch.Tensor, layer: int, block_ids: list[int], index: torch.Tensor | None = None
) -> torch.Tensor:
    """A contiguous copy of the layer's planes of `block_ids`, on the pool's device."""
    index = _index(pool, block_ids) if index is None else index
    return raw(pool[layer]).index_select(1, index).view(pool.dtype)


def scatter_layer(
    pool: torch.Tensor, layer: int, block_ids: list[int], payload: torch.Tensor
) -> None:
    """Write a payload (any device, same dtype and layer_shape) into the layer's `block_ids`."""
    raw(pool[layer]).index_copy_(1, _index(pool, block_ids), raw(payload.to(pool.device)))


def payload_error(pool: torch.Tensor, header: LayerHeader, nbytes: int) -> str | None:
    """Why a layer payload cannot be written into `pool`, or None if it fits. The frame may
    carry fewer KV heads than the pool holds (the ledger checks which)."""
    if header.dtype != str(pool.dtype):
        return f"dtype {header.dtype} differs from the pool's {pool.dtype}"
    expected = layer_shape(pool, len(header.block_ids))
    if len(header.shape) == 5:
        expected[3] = header.shape[3]
    if header.shape != expected:
        return f"shape {header.shape} differs from the expected {expected}"
    expected_bytes = math.prod(expected) * pool.element_size()
    if nbytes != expected_bytes:
        return f"payload of {nbytes} bytes, expected {expected_bytes}"
    return None


def as_bytes(payload: torch.Tensor) -> Any:
    """A zero-copy uint8 numpy view of a contiguous CPU tensor (bf16 has no numpy dtype).

    The array keeps the tensor alive, so it can be handed to zmq with copy=False."""
    return payload.view(torch.uint8).reshape(-1).numpy()


def payload_view(payload: torch.Tensor | bytes) -> memoryview:
    """A completion payload as a flat byte view without a copy (it keeps the tensor alive until
    zmq has sent it); ValueError for a tensor not on the host or not contiguous."""
    if isinstance(payload, torch.Tensor):
        if payload.device.type != "cpu" or not payload.is_contiguous():
            raise ValueError(
                f"a completion payload must be a contiguous host tensor, got one on "
                f"{payload.device} (contiguous: {payload.is_contiguous()})"
            )
        return memoryview(as_bytes(payload))
    return memoryview(payload).cast("B")


def from_bytes(buffer: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A tensor over a received buffer, without a copy; only ever read from."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers warn; we never write
        flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(dtype).view(shape)


class HostStager:
    """Gathers a layer into host memory: synchronously on CPU; on CUDA on a side stream.

    On CUDA the side stream first waits for everything queued so far on the current stream
    (the layer's KV is final when send_layer is called), then gathers and copies into pinned
    memory without blocking, so later layers keep computing. The returned event says when the
    host copy is complete; until then the source blocks are still being read.
    """

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def stage(
        self, pool: torch.Tensor, layer: int, block_ids: list[int]
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if self._stream is None:
            return gather_layer(pool, layer, block_ids), None
        self._stream.wait_stream(torch.cuda.current_stream(pool.device))
        index = upload_ids(block_ids, pool.device, self._stream)
        with torch.cuda.stream(self._stream):
            gathered = gather_layer(pool, layer, block_ids, index)
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return host, ready

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()


class PoolWriter:
    """Writes a layer frame's KV heads into a pool that holds the model's KV heads `heads`
    (all of them on a node of one rank). A tensor-parallel decode node's rank 0 uses a
    subclass that also hands the heads of its other ranks to them (`kv_transfer.tp`)."""

    def __init__(self, pool: torch.Tensor, heads: range | None = None) -> None:
        self.pool = pool
        self.heads = heads if heads is not None else range(pool.shape[4])

    @property
    def num_heads(self) -> int:
        """The model's KV heads, which every transfer must deliver."""
        return len(self.heads)

    def write(self, layer: int, block_ids: list[int], head_start: int, payload: torch.Tensor):
        write_heads(self.pool, self.heads, layer, block_ids, head_start, payload)


def write_heads(
    pool: torch.Tensor,
    pool_heads: range,
    layer: int,
    block_ids: list[int],
    head_start: int,
    payload: torch.Tensor,
) -> None:
    """Write the heads of `payload` (the model's heads head_start..) that `pool` holds. A
    float8 pool takes a payload of its dtype or its bytes (uint8: what a TP rank receives)."""
    frame = range(head_start, head_start + payload.shape[3])
    lo, hi = max(frame.start, pool_heads.start), min(frame.stop, pool_heads.stop)
    if lo >= hi:
        return
    part = payload[:, :, :, lo - head_start : hi - head_start]
    if lo == pool_heads.start and hi == pool_heads.stop and part.shape[3] == pool.shape[4]:
        scatter_layer(pool, layer, block_ids, part)
        return
    target = pool[layer][:, :, :, lo - pool_heads.start : hi - pool_heads.start]
    raw(target).index_copy_(1, _index(pool, block_ids), raw(part.to(pool.device)))


def write_layer_frame(
    writer: PoolWriter, ledger: ReceiverLedger, header: LayerHeader, buffer: memoryview
) -> None:
    """A receiver's handling of one layer frame: check it against the reservation and the pool,
    write it, and record it; any problem fails that transfer only (never raises)."""
    entry = ledger.accept_layer(header)
    if entry is None:
        return
    pool = writer.pool
    error = payload_error(pool, header, buffer.nbytes)
    if error is not None:
        ledger.fail(header.request_id, error)
        return
    payload = from_bytes(buffer, pool.dtype, header.shape)
    try:
        writer.write(header.layer, header.block_ids, header.head_start, payload)
    except RuntimeError as exc:  # e.g. out of device memory for the staging copy
        log.exception("writing KV of %s failed", header.request_id)
        ledger.fail(header.request_id, f"write failed: {exc}")
        return
    heads = range(header.head_start, header.head_start + header.shape[3])
    ledger.layer_written(entry, header.layer, heads, buffer.nbytes)
