"""The transfer interface: per-request state, its state machine, and the sender/receiver ABCs.

Pure Python: torch appears only in type hints, so the state machine imports without it.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from common.engine.kv_format import KVFormat

if TYPE_CHECKING:
    import torch


class TransferState(enum.Enum):
    PENDING = "pending"  # announced (sender: begin, receiver: expect), no layer yet
    IN_FLIGHT = "in_flight"  # at least one layer sent / written
    DONE = "done"  # every layer and the completion notice went through
    FAILED = "failed"  # aborted, malformed, incomplete or past its deadline; see `error`


_LEGAL: dict[TransferState, frozenset[TransferState]] = {
    TransferState.PENDING: frozenset({TransferState.IN_FLIGHT, TransferState.FAILED}),
    TransferState.IN_FLIGHT: frozenset({TransferState.DONE, TransferState.FAILED}),
    TransferState.DONE: frozenset(),
    TransferState.FAILED: frozenset(),
}


@dataclass
class Transfer:
    """One request's transfer as seen by one side (sender or receiver)."""

    request_id: str
    block_ids: list[int]  # sender: source blocks; receiver: reserved destination blocks
    num_layers: int
    deadline: float  # time.monotonic() value after which the transfer fails
    state: TransferState = TransferState.PENDING
    layers_done: int = 0  # layers sent (sender) or written into the pool (receiver)
    # KV bytes moved so far, whole blocks (a block's unused slots too): sender, what left its
    # pool; receiver, the layer payloads that arrived (every head, also those a TP rank 0
    # forwards), or for a sender that wrote the pool itself, the blocks' bytes once complete.
    nbytes: int = 0
    error: str | None = None
    # receiver: FAILED because the sending node ended the request and has answered the router
    # itself (a first token that finished it, the router's abort, its own error): the
    # receiving node only frees the blocks (AbortHeader.answered).
    answered_by_sender: bool = False
    metadata: dict[str, Any] | None = None  # receiver: what the sender attached on completion
    # receiver: the completion's raw payload frame (read-only; None when it had none)
    payload: memoryview | bytes | None = None
    started_at: float = field(default_factory=time.monotonic)
    in_flight_at: float | None = None  # first layer sent / received
    finished_at: float | None = None

    @property
    def is_terminal(self) -> bool:
        return self.state in (TransferState.DONE, TransferState.FAILED)

    def move_to(self, state: TransferState, error: str | None = None) -> None:
        """Take one legal step of the state machine; anything else is a bug and raises."""
        if state not in _LEGAL[self.state]:
            raise ValueError(
                f"transfer {self.request_id!r}: illegal transition {self.state.name} -> {state.name}"
            )
        self.state = state
        if error is not None:
            self.error = error
        if state is TransferState.IN_FLIGHT:
            self.in_flight_at = time.monotonic()
        if self.is_terminal:
            self.finished_at = time.monotonic()


@dataclass(frozen=True)
class TransferConfig:
    transport: str = "zmq"
    deadline_s: float = 30.0  # from begin()/expect() to the completion notice
    fail_rate: float = 0.0  # tests: fraction of transfers the sender fails on purpose
    seed: int = 0  # seeds the sender's failure-injection RNG
    # Tensor parallel (zmq): this prefill rank's pool holds the model's KV heads from
    # head_start on, and `senders` ranks of its node each ship their heads.
    head_start: int = 0
    senders: int = 1
    # Pipeline parallel: this stage's pool holds the model's layers from layer_start on (its
    # pool layer 0); frames and writes name the model's layer numbers.
    layer_start: int = 0
    # How long a closing sender's sockets keep trying to deliver what they were handed.
    close_linger_s: float = 5.0
    # The pool's format (the node's `RuntimeInfo.kv_format`). A sender announces it in each
    # transfer's first message; a receiver fails a transfer announcing another one, or none.
    # None: no announcement and no check (tests of the wire alone).
    kv_format: KVFormat | None = None

    def __post_init__(self) -> None:
        if not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s}")
        if not 0.0 <= self.fail_rate <= 1.0:
            raise ValueError(f"fail_rate must be in [0, 1], got {self.fail_rate}")
        if not self.close_linger_s >= 0:
            raise ValueError(f"close_linger_s must be >= 0, got {self.close_linger_s}")


class KVSender(ABC):
    """Prefill side: ships a request's KV blocks, layer by layer, into a receiver's pool.

    Ownership: the caller keeps the source blocks allocated and unmodified from begin() until
    poll() has reported the transfer terminal (or until abort() returned), then frees them. After
    that the sender never reads them again. All methods are called from one thread.

    A transfer that fails (deadline, injected failure, full send queue, unreachable receiver) is
    reported by poll(); send_layer()/complete() on it are then no-ops, and abort() on a request
    the sender no longer knows is a no-op too, so failure paths need no bookkeeping of their own.
    """

    @abstractmethod
    def __init__(self, pool: torch.Tensor, config: TransferConfig) -> None:
        """`pool` is the prefill node's KV pool, `[num_layers, planes, num_blocks, block_size,
        heads, head_dim]` (kv_transfer.pool_io); ValueError for any other shape."""

    @abstractmethod
    def begin(
        self,
        request_id: str,
        dest_address: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
    ) -> Transfer:
        """Start a transfer (PENDING). ValueError if the id is already active, the block lists
        differ in length, or a source block is outside the pool."""

    @abstractmethod
    def send_layer(self, request_id: str, layer: int) -> None:
        """Ship one layer's planes (K and V, or MLA's latent) of the request's blocks (once per
        layer, any order).

        The layer's KV must be final when this is called. ValueError for an unknown request,
        a layer out of range or sent twice."""

    def send_layers(self, request_id: str, layers: range) -> None:
        """`send_layer` for each of `layers` (all final by now); a transport that can ship them
        in one operation does (cuda_ipc: one copy kernel)."""
        for layer in layers:
            self.send_layer(request_id, layer)

    def flush(self) -> None:
        """Wait until no copy reads the source blocks of any transfer any more and hand what
        is queued to the wire (a tensor-parallel rank after `complete`: rank 0 may reuse
        the blocks in its next step). Transports that copy synchronously do nothing."""
        return None

    @abstractmethod
    def complete(
        self,
        request_id: str,
        metadata: dict[str, Any],
        payload: torch.Tensor | bytes | None = None,
    ) -> None:
        """After every layer: send the completion notice carrying msgpack-able `metadata`, and
        `payload` (a contiguous host tensor or bytes, raw) as a frame behind it, which the
        receiver hands over as `Transfer.payload`. The sender owns `payload` from here on (it
        is sent without a copy): the caller must not write it again.

        ValueError if layers are missing, `metadata` cannot be packed or `payload` is not on
        the host."""

    @abstractmethod
    def abort(self, request_id: str, reason: str) -> None:
        """Tell the receiver to drop the request; local state FAILED (reported by poll)."""

    def decline(self, request_id: str, dest_address: str, reason: str) -> None:
        """Promise the receiver at `dest_address` that this sender will never write the blocks
        it reserved for `request_id` (the request ended before its transfer began), so it may
        reuse them now. Only transports whose senders write the pool themselves need it: their
        receivers hold a cancelled reservation until the writer confirms (cuda_ipc, nixl).
        A request already begun here is ended with `abort`, not this. Default: nothing to
        say (a zmq receiver frees a cancelled reservation at once)."""
        return None

    @abstractmethod
    def poll(self) -> list[Transfer]:
        """Transfers that became terminal since the last poll, which forgets them.

        Also fails (and aborts on the receiver) transfers past their deadline."""

    @abstractmethod
    def close(self) -> None:
        """Release sockets. What a transport already handed to its sockets (all of a transfer
        it reported DONE, in zmq's case) gets up to `close_linger_s` to reach its receiver, so a
        node that exits right after a DONE does not lose that request's KV; the rest is
        dropped. Idempotent."""

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVReceiver(ABC):
    """Decode side: writes arriving KV into the blocks it reserved in its own pool.

    Ownership: the caller allocates the destination blocks before expect() and frees them
    only after poll() reported the transfer FAILED, or after a cancel() that returned True;
    on DONE they belong to the request. expect() must happen before the sender learns the
    address and block ids (i.e. before the reservation is sent), since frames for unexpected
    requests are dropped. poll() never raises because of what arrives: a bad frame fails its
    transfer or is dropped. Layers are written on the calling thread's current CUDA stream (a
    plain copy on CPU), so work queued after poll() on that stream sees them; a sender that
    writes the pool itself (cuda_ipc) reports completion only once its writes have finished.
    All methods are called from one thread.
    """

    address: str  # what senders pass as dest_address (the real port when bound to port 0)

    @abstractmethod
    def __init__(self, pool: torch.Tensor, config: TransferConfig, bind_address: str) -> None:
        """`pool` is the decode node's KV pool, shaped as a sender's; bind to `bind_address`
        at once."""

    @abstractmethod
    def expect(self, request_id: str, block_ids: list[int]) -> Transfer:
        """Register the blocks reserved for a request (PENDING); its deadline starts now.

        ValueError if the id is already expected or a block is outside the pool or repeated."""

    @abstractmethod
    def poll(self, timeout_s: float = 0.0) -> list[Transfer]:
        """Process arrived frames; return transfers that became terminal since the last poll.

        DONE carries `.metadata`; FAILED carries `.error` (sender abort, malformed or mismatched
        frame, incomplete on completion, deadline passed). Waits up to `timeout_s` only while
        there is nothing to return."""

    @abstractmethod
    def cancel(self, request_id: str) -> bool:
        """The request was aborted locally. Returns whether its blocks may be reused now.

        True: the request is forgotten, later frames for it are dropped, poll() never reports
        it; free the blocks at once. Transports through which every byte is written by the
        receiver itself (zmq, loopback) always return True, as does any transport for an id
        it does not know (never expected, or already reported by poll()).
        False: a sender may still be writing into the blocks on its own (cuda_ipc writes the
        decode pool straight from the prefill GPU). The receiver asks the sender to stop, and a
        later poll() reports the transfer FAILED with error "cancelled" once the sender
        confirmed that its writes are over, or once a grace period passed without word from it
        (a dead sender writes nothing more). Free the blocks only then."""

    def withdraw(self, request_id: str) -> None:
        """Forget an expected transfer whose destination blocks no sender was ever told of
        (the reservation never left this node): nobody can write them, so unlike `cancel` it
        never holds the blocks, whatever the transport. Free them at once."""
        self._ledger.table.forget(request_id)  # type: ignore[attr-defined]

    @abstractmethod
    def close(self) -> None:
        """Unbind. Idempotent."""

    @property
    def late_frames(self) -> int:
        """Frames dropped because no transfer expected them (every receiver keeps its
        `ReceiverLedger` as `_ledger`)."""
        return self._ledger.late_frames  # type: ignore[attr-defined]

    @property
    def malformed_frames(self) -> int:
        """Frames dropped because they could not be decoded and named no request."""
        return self._ledger.malformed_frames  # type: ignore[attr-defined]

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
