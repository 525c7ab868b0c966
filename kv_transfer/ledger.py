"""Per-request bookkeeping every transport shares: who is in flight, what arrived, what expired.

Pure Python (no torch): transports decide how bytes move, the ledgers decide whether a call or a
frame is legal and drive each Transfer through its state machine. Terminal transfers leave the
active table at once (so late frames for them are simply unknown) and wait in a list until the
next drain(), which is what poll() returns.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from common.engine.kv_format import KVFormat
from kv_transfer.base import Transfer, TransferConfig, TransferState
from kv_transfer.frames import LayerHeader

log = logging.getLogger(__name__)

INJECTED_FAILURE = "injected failure"
DEADLINE_EXCEEDED = "deadline exceeded"


class _HasTransfer(Protocol):
    transfer: Transfer


E = TypeVar("E", bound=_HasTransfer)


class TransferTable(Generic[E]):
    """Active entries by request id, plus transfers turned terminal since the last drain()."""

    def __init__(self) -> None:
        self._active: dict[str, E] = {}
        self._finished: list[Transfer] = []

    def add(self, entry: E) -> None:
        request_id = entry.transfer.request_id
        if request_id in self._active:
            raise ValueError(f"transfer {request_id!r} is already active")
        self._active[request_id] = entry

    def get(self, request_id: str) -> E | None:
        return self._active.get(request_id)

    def is_unreported(self, request_id: str) -> bool:
        """Terminal but not drained yet."""
        return any(t.request_id == request_id for t in self._finished)

    def finish(self, request_id: str, state: TransferState, error: str | None = None) -> E | None:
        entry = self._active.get(request_id)
        if entry is not None:
            entry.transfer.move_to(state, error)  # raises before anything changed if illegal
            del self._active[request_id]
            self._finished.append(entry.transfer)
        return entry

    def forget(self, request_id: str) -> None:
        self._active.pop(request_id, None)
        self._finished = [t for t in self._finished if t.request_id != request_id]

    def overdue(self, now: float) -> list[E]:
        """Active entries past their deadline (the transport fails them its own way)."""
        return [e for e in self._active.values() if now >= e.transfer.deadline]

    def drain(self) -> list[Transfer]:
        finished, self._finished = self._finished, []
        return finished

    @property
    def has_finished(self) -> bool:
        return bool(self._finished)

    def next_deadline(self) -> float | None:
        return min((e.transfer.deadline for e in self._active.values()), default=None)

    def wait_time(self, timeout_s: float) -> float | None:
        """How long a receiver's poll(timeout_s) may block for news: None when it must not wait
        (no timeout, or results are already waiting), else up to the earliest deadline."""
        if timeout_s <= 0 or self.has_finished:
            return None
        now = time.monotonic()
        until = now + timeout_s
        next_deadline = self.next_deadline()
        if next_deadline is not None:
            until = min(until, next_deadline)
        return max(0.0, until - now)


def _frame_heads(header: LayerHeader) -> range | None:
    """The model's KV heads a layer frame carries; None when its shape is not a layer's."""
    if len(header.shape) != 5 or header.shape[3] < 1:
        return None
    return range(header.head_start, header.head_start + header.shape[3])


def _check_block_ids(what: str, block_ids: list[int], num_blocks: int | None) -> None:
    """Ints in [0, num_blocks) (only >= 0 when the pool is remote), no repeats."""
    limit = num_blocks if num_blocks is not None else float("inf")
    bad = [
        b for b in block_ids if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < limit
    ]
    if bad:
        raise ValueError(f"{what} block ids {bad[:8]} outside [0, {num_blocks or 'inf'})")
    if len(set(block_ids)) != len(block_ids):
        raise ValueError(f"{what} block ids repeat: {block_ids}")


@dataclass
class Outgoing:
    transfer: Transfer  # block_ids are the source blocks
    dest_address: str
    dst_block_ids: list[int]
    doomed: bool  # picked by failure injection: aborts at its first send_layer
    layers: set[int] = field(default_factory=set)  # sent


class SenderLedger:
    """The sender's side of every transfer; the transport calls it before moving bytes."""

    def __init__(
        self, config: TransferConfig, num_layers: int, num_blocks: int, block_bytes: int = 0
    ) -> None:
        self.config = config
        self.num_layers = num_layers
        # The model layers this sender's pool holds (a pipeline stage's: from layer_start on).
        self.layers = range(config.layer_start, config.layer_start + num_layers)
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes  # one block of one layer, every plane (Transfer.nbytes)
        self.table: TransferTable[Outgoing] = TransferTable()
        self._rng = random.Random(config.seed)  # failure injection, deterministic per sender

    def begin(
        self, request_id: str, dest_address: str, src_block_ids: list[int], dst_block_ids: list[int]
    ) -> Outgoing:
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError(
                f"transfer {request_id!r}: {len(src_block_ids)} source blocks, "
                f"{len(dst_block_ids)} destination blocks"
            )
        if not src_block_ids:
            raise ValueError(f"transfer {request_id!r}: no blocks")
        _check_block_ids("source", list(src_block_ids), self.num_blocks)
        _check_block_ids("destination", list(dst_block_ids), None)
        doomed = self.config.fail_rate > 0 and self._rng.random() < self.config.fail_rate
        transfer = Transfer(
            request_id,
            list(src_block_ids),
            self.num_layers,
            deadline=time.monotonic() + self.config.deadline_s,
        )
        entry = Outgoing(transfer, dest_address, list(dst_block_ids), doomed)
        self.table.add(entry)
        return entry

    def lookup(self, request_id: str) -> Outgoing | None:
        """The active entry; None if it already turned terminal (the caller learns from poll)."""
        entry = self.table.get(request_id)
        if entry is None and not self.table.is_unreported(request_id):
            raise ValueError(f"no transfer {request_id!r} (never begun, or already polled)")
        return entry

    def check_layer(self, entry: Outgoing, layer: int) -> None:
        if layer not in self.layers:
            raise ValueError(f"layer {layer} outside {self.layers}")
        if layer in entry.layers:
            raise ValueError(f"transfer {entry.transfer.request_id!r}: layer {layer} sent twice")

    def check_complete(self, entry: Outgoing) -> None:
        missing = sorted(set(self.layers) - entry.layers)
        if missing:
            raise ValueError(
                f"transfer {entry.transfer.request_id!r}: layers {missing} not sent before complete"
            )

    def layer_sent(self, entry: Outgoing, layer: int) -> None:
        entry.layers.add(layer)
        entry.transfer.layers_done = len(entry.layers)
        entry.transfer.nbytes += len(entry.transfer.block_ids) * self.block_bytes
        if entry.transfer.state is TransferState.PENDING:
            entry.transfer.move_to(TransferState.IN_FLIGHT)


@dataclass
class Incoming:
    transfer: Transfer  # block_ids are the reserved destination blocks
    layers: set[int] = field(default_factory=set)  # every KV head written into the pool
    heads: dict[int, set[int]] = field(default_factory=dict)  # layer -> heads written so far
    completes: int = 0  # completion notices so far (one per sending prefill rank)
    metadata: dict[str, Any] = field(default_factory=dict)  # merged from the notices
    payload: memoryview | bytes | None = None  # the one notice's payload that carried one
    announced: bool = False  # a sender announced a KV format that fits this pool


class ReceiverLedger:
    """The receiver's side: validates each frame against what was reserved, in arrival order.

    A layer is written once all `num_heads` KV heads of the model arrived (one frame from a
    prefill node of one rank; one per sending rank, each with its head range, from a
    tensor-parallel one). The transfer is DONE once `senders` completion notices arrived and
    every layer is written: a decode node never admits a request on a half-written block.

    Every failure goes through `fail`, which a transport whose senders write the pool
    themselves vetoes with `hold` while one of them may still be writing (the transfer stays
    active, and the transport fails it with `fail_now` once they stopped).
    """

    def __init__(
        self,
        config: TransferConfig,
        num_layers: int,
        num_blocks: int,
        num_heads: int = 1,
        block_bytes: int = 0,
    ) -> None:
        self.config = config
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.num_heads = num_heads  # the model's KV heads (a TP decode pool holds some)
        self.block_bytes = block_bytes  # one block of one layer of this pool, every plane
        self.table: TransferTable[Incoming] = TransferTable()
        # Frames for no expected transfer (cancelled, failed, finished, never expected): dropped
        # before they touch the pool, so a late frame never writes into a freed block.
        self.late_frames = 0
        self.malformed_frames = 0  # frames that name no request and cannot be decoded
        self._agreed: dict[str, Any] | None = None  # the last announced format found equal
        # (request id, error) -> True: the transport holds the transfer (see the docstring).
        self.hold: Callable[[str, str], bool] | None = None

    def expect(self, request_id: str, block_ids: list[int]) -> Transfer:
        if not block_ids:
            raise ValueError(f"transfer {request_id!r}: no blocks reserved")
        _check_block_ids("reserved", list(block_ids), self.num_blocks)
        transfer = Transfer(
            request_id,
            list(block_ids),
            self.num_layers,
            deadline=time.monotonic() + self.config.deadline_s,
        )
        self.table.add(Incoming(transfer))
        return transfer

    def accept_layer(self, header: LayerHeader) -> Incoming | None:
        """The entry to write into, or None when the frame is dropped or fails its transfer."""
        entry = self._known(header.request_id, "layer")
        if entry is None:
            return None
        heads = _frame_heads(header) or range(0)  # a bad shape fails at the payload check
        arrived = entry.heads.get(header.layer, set())
        if not 0 <= header.layer < self.num_layers:
            self.fail(header.request_id, f"layer {header.layer} outside [0, {self.num_layers})")
        elif heads.start < 0 or heads.stop > self.num_heads:
            self.fail(header.request_id, f"KV heads {heads} outside [0, {self.num_heads})")
        elif header.layer in entry.layers or arrived.intersection(heads):
            self.fail(header.request_id, f"layer {header.layer} heads {heads} arrived twice")
        elif header.block_ids != entry.transfer.block_ids:
            self.fail(header.request_id, "block ids differ from the reservation")
        elif (error := self.check_format(entry, header.kv_format)) is not None:
            self.fail(header.request_id, error)
        else:
            return entry
        return None

    def check_format(self, entry: Incoming, announced: dict[str, Any] | None) -> str | None:
        """Why KV of a sender that announced `announced` (None: nothing in this message) must
        not enter this pool, naming both sides' values; None when it may (recorded on `entry`).
        The one comparison of every transport: senders announce in a transfer's first message
        (their first layer frame, or cuda_ipc's "start"), checked before anything is written."""
        mine = self.config.kv_format
        if mine is None:
            return None
        if announced is None:
            if entry.announced:
                return None
            return f"the sender announced no KV format; this decode pool holds {mine.describe()}"
        if announced != self._agreed:
            try:
                theirs = KVFormat.from_dict(announced)
            except ValueError as exc:
                return f"the sender announced a malformed KV format: {exc}"
            diff = theirs.mismatch(mine, ("prefill node, sender", "decode node, receiver"))
            if diff is not None:
                log.warning("refused KV of another format for %s: %s", entry.transfer.request_id,
                            diff)  # fmt: skip
                return f"the KV pools of the two nodes differ: {diff}"
            self._agreed = dict(announced)
        entry.announced = True
        return None

    def layer_written(
        self, entry: Incoming, layer: int, heads: range | None = None, nbytes: int = 0
    ) -> None:
        """`heads` of `layer` (None: all of them) arrived as a payload of `nbytes` bytes."""
        entry.transfer.nbytes += nbytes
        arrived = entry.heads.setdefault(layer, set())
        arrived.update(range(self.num_heads) if heads is None else heads)
        if len(arrived) == self.num_heads:
            entry.layers.add(layer)
        entry.transfer.layers_done = len(entry.layers)
        if entry.transfer.state is TransferState.PENDING:
            entry.transfer.move_to(TransferState.IN_FLIGHT)

    def complete(
        self,
        request_id: str,
        metadata: dict[str, Any],
        senders: int = 1,
        payload: memoryview | bytes | None = None,
    ) -> None:
        """One sending rank's notice (with its payload, if any: one rank's at most); each sent
        its frames before it on its own connection, so once all `senders` notices are in,
        every frame is."""
        entry = self._known(request_id, "complete")
        if entry is None:
            return
        if payload is not None and entry.payload is not None:
            self.fail(request_id, "two completion notices carried a payload")
            return
        entry.completes += 1
        entry.metadata.update(metadata)
        if payload is not None:
            entry.payload = payload
        if entry.completes < senders:
            return
        missing = self.num_layers - len(entry.layers)
        if missing:
            self.fail(request_id, f"incomplete: {missing} of {self.num_layers} layers missing")
            return
        entry.transfer.metadata = entry.metadata
        entry.transfer.payload = entry.payload
        self.table.finish(request_id, TransferState.DONE)

    def started(self, request_id: str) -> Incoming | None:
        """A sender announced the transfer (transports whose sender writes the pool itself);
        its format passed `check_format`."""
        entry = self._known(request_id, "start")
        if entry is not None and entry.transfer.state is TransferState.PENDING:
            entry.transfer.move_to(TransferState.IN_FLIGHT)
        return entry

    def complete_written(
        self,
        request_id: str,
        metadata: dict[str, Any],
        payload: memoryview | bytes | None = None,
        heads: range | None = None,
        senders: int = 1,
        layers: range | None = None,
    ) -> None:
        """Completion notice of a sender that wrote `heads` (None: all) of `layers` (None:
        every layer; a pipeline stage's: its own) into the pool itself (CUDA IPC) and vouches
        that the writes have finished: no layer frames to check. Then as `complete`."""
        entry = self._known(request_id, "complete")
        if entry is None:
            return
        heads = range(self.num_heads) if heads is None else heads
        layers = range(self.num_layers) if layers is None else layers
        if not len(heads) or heads.start < 0 or heads.stop > self.num_heads:
            self.fail(request_id, f"KV heads {heads} outside [0, {self.num_heads})")
            return
        if not len(layers) or layers.start < 0 or layers.stop > self.num_layers:
            self.fail(request_id, f"layers {layers} outside [0, {self.num_layers})")
            return
        if any(entry.heads.get(layer, set()).intersection(heads) for layer in layers):
            self.fail(request_id, f"KV heads {heads} of layers {layers} arrived twice")
            return
        # a direct write moved whole blocks of these heads, each of its layers
        nbytes = len(entry.transfer.block_ids) * self.block_bytes * len(heads) // self.num_heads
        for layer in layers:
            self.layer_written(entry, layer, heads, nbytes)
        self.complete(request_id, metadata, senders, payload)

    def abort(self, request_id: str, reason: str, answered: bool = False) -> None:
        """The sender's abort notice; `answered`: its node has answered the router."""
        entry = self._known(request_id, "abort")
        if entry is not None:
            entry.transfer.answered_by_sender = answered
            self.fail(request_id, f"aborted by sender: {reason}")

    def fail(self, request_id: str, error: str) -> None:
        """FAILED(`error`), unless the transport's `hold` takes the ending over."""
        if self.hold is not None and self.table.get(request_id) is not None:
            if self.hold(request_id, error):
                return
        self.fail_now(request_id, error)

    def fail_now(self, request_id: str, error: str) -> None:
        if self.table.finish(request_id, TransferState.FAILED, error) is not None:
            log.debug("transfer %s failed: %s", request_id, error)

    def expire(self) -> None:
        """Fail every transfer past its deadline (transports that hold no reservation longer)."""
        for entry in self.table.overdue(time.monotonic()):
            self.fail(entry.transfer.request_id, DEADLINE_EXCEEDED)

    def _known(self, request_id: str, kind: str) -> Incoming | None:
        entry = self.table.get(request_id)
        if entry is None:
            self.late_frames += 1
            log.debug("dropped %s frame for unexpected request %r", kind, request_id)
        return entry
