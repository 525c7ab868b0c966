"""Headers of the frames a sender puts on the wire, with one msgpack codec (no torch).

A header is `{"kind": ..., **fields}`. A "layer" header is followed by one payload frame with
the layer's planes (K and V, or MLA's latent) of the request's blocks (raw bytes: an FP8
pool's too). A "complete" header
with `payload_bytes` > 0 is followed by one raw payload frame of exactly that many bytes (bulk
data too large for the header, e.g. EAGLE-3 prompt hidden states); otherwise it travels alone,
as does "abort". A sender's first layer frame of a transfer announces its pool's
`KVFormat`, which the receiver checks before writing anything. Decoding
checks every field's type, so what reaches the receiver's logic is well-typed; whether it fits
the expected transfer and the pool is the receiver's check.

Between different TP sizes each prefill rank ships the KV heads its pool holds (a layer frame's
`head_start`) and ends with its own "complete" that says how many ranks send (`senders`). With
a cluster secret set, headers are signed (`common.protocol.wire_auth`); payload frames are not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from common.protocol.messages import MessageError, from_fields
from common.protocol.wire_auth import SIGNER, SignatureError

MAX_HEADER_BYTES = 16 << 20  # a header is block ids plus small metadata; refuse anything huge
# A completion payload is bulk data the sender computed (EAGLE-3 rows of an 8k-token prompt on
# Llama-3.1-8B: 192 MiB); the bound only refuses a corrupt size before anything is allocated.
MAX_PAYLOAD_BYTES = 1 << 30


@dataclass(frozen=True)
class LayerHeader:
    request_id: str
    layer: int
    block_ids: list[int]  # destination blocks, equal to the receiver's reservation
    dtype: str  # str(torch dtype) of the payload, e.g. "torch.bfloat16"
    shape: list[int]  # [planes, len(block_ids), block_size, heads in this frame, head_dim]
    head_start: int = 0  # the model's KV head number of the frame's first head
    # The sender's KVFormat as a dict, on each sender's first layer frame of a transfer only.
    kv_format: dict[str, Any] | None = None


@dataclass(frozen=True)
class CompleteHeader:
    request_id: str
    metadata: dict[str, Any]  # msgpack-able, str keys (first token, timing, ...)
    senders: int = 1  # prefill ranks that each send a share of the heads and a "complete"
    payload_bytes: int = 0  # size of the raw frame that follows; 0: none follows


@dataclass(frozen=True)
class AbortHeader:
    request_id: str
    reason: str
    # True: the sending node ended the request itself (KVSender.abort / decline) and has
    # answered the router; False: the transfer failed inside the sender (deadline, full queue,
    # cancel), and the receiving node must say so, since a tensor-parallel rank's own sender
    # has nobody else to tell.
    answered: bool = False
    # Prefill ranks that each send (as CompleteHeader's): a cuda_ipc receiver whose blocks
    # several ranks may write frees them once each of them stopped.
    senders: int = 1


Header = LayerHeader | CompleteHeader | AbortHeader

KINDS: dict[str, type] = {"layer": LayerHeader, "complete": CompleteHeader, "abort": AbortHeader}
_KIND_OF: dict[type, str] = {cls: kind for kind, cls in KINDS.items()}


class FrameError(ValueError):
    """A frame that cannot be used; `request_id` is set when the header named one."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


def encode_header(header: Header) -> bytes:
    """ValueError if a field (the metadata, in practice) would not decode on the other side."""
    try:
        frame = msgpack.packb(
            {"kind": _KIND_OF[type(header)], **dataclasses.asdict(header)}, use_bin_type=True
        )
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{type(header).__name__} is not msgpack-able: {exc}") from None
    frame = SIGNER.sign(frame)
    if isinstance(header, CompleteHeader):  # free-form metadata: refuse here what the peer would
        try:
            decode_header(frame)
        except FrameError as exc:
            raise ValueError(f"metadata does not survive msgpack: {exc}") from None
    return frame


def completion_error(header: CompleteHeader, parts: int, nbytes: int | None) -> str | None:
    """Why a completion of `parts` parts whose payload frame holds `nbytes` (None: no payload
    part) does not match its header, naming both; None when it does."""
    want = header.payload_bytes
    if not 0 <= want <= MAX_PAYLOAD_BYTES:
        return f"completion payload of {want} bytes outside [0, {MAX_PAYLOAD_BYTES}]"
    expected_parts = 2 if want else 1
    if parts != expected_parts:
        return f"completion with payload_bytes={want} has {parts} parts, not {expected_parts}"
    if want and nbytes != want:
        return f"completion payload is {nbytes} bytes, its header says {want}"
    return None


def decode_header(frame: bytes, kinds: Mapping[str, type] = KINDS) -> Any:
    """Raises FrameError, never anything else. A transport with messages of its own passes
    `kinds` (these headers' kinds plus its own) to get the same checks for all of them."""
    if len(frame) > MAX_HEADER_BYTES:
        raise FrameError(f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        frame = SIGNER.verify(frame)
    except SignatureError as exc:
        raise FrameError(str(exc)) from None
    try:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise FrameError(f"undecodable header: {type(exc).__name__}") from None
    if not isinstance(raw, dict):
        raise FrameError("header is not a map")
    request_id = raw.get("request_id")
    request_id = request_id if isinstance(request_id, str) else None
    kind = raw.pop("kind", None)
    cls = kinds.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise FrameError("unknown header kind", request_id)
    try:
        return from_fields(cls, raw)
    except MessageError as exc:
        raise FrameError(str(exc), request_id) from None
