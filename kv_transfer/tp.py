"""KV transfer of tensor-parallel nodes: which rank ships or writes which KV heads.

Prefill node of P ranks: every rank holds the KV heads `layout.kv_heads(rank)`; the first
owner of each head ships it (`shipping_ranks`: with replicated heads the other copies stay
home). Each shipping rank has its own sender; its frames carry the heads' range
(`TransferConfig.head_start`) and its completion notice says how many ranks send
(`senders`). Rank 0's `TPSender` mirrors every call the node makes to the ranks'
senders as a command between steps; a step that ships layer by layer runs each rank's
`send_layer` from the same per-layer hook (step flag `HAS_LAYER_HOOK`).

Decode node of D ranks: rank 0 binds the node's one KV address and receives every frame; its
`TPPoolWriter` writes the heads its pool holds and hands each frame to the other ranks (one
command with the payload), which write the heads theirs hold, before the ledger counts the
frame. The transfer is DONE only when every head of every layer arrived from every sender
(`ReceiverLedger`), so the decode node never runs on a half-written block, whatever P and D.

cuda_ipc (zmq's frames where IPC cannot work, through the same writer): every decode rank
exports its pool, and rank 0 collects the exports once at start (a collective: `tp_receiver`
and `decode_rank_handler`) and answers each sender's "hello" with all of them. Each shipping
prefill rank then writes its heads straight into the pool of every decode rank holding them
(`kv_transfer.ipc_writer`) on its own side stream, and sends its own "complete" once its copies
finished; rank 0 counts heads as above. A rank > 0 waits for its copies after each "complete"
(`KVSender.flush`), before rank 0's next step may reuse the blocks. Nodes of several ranks
refuse other transports (nixl) at start.

Pipeline-parallel prefill node (pp stages of P ranks): each stage holds only its layers' KV,
and its shipping ranks ship those layers themselves, as soon as their stage has computed them:
a sender per shipping rank per stage (`TransferConfig.layer_start`), `senders` = shipping ranks
x pp. Rank 0's commands reach every stage in step order (`common.engine.tp_link`), so a stage
begins, ships, completes or aborts a transfer exactly where stage 0 did. The receiver counts
heads per layer as above: DONE only once every stage's layers and notices are in. A decode node
of several stages is refused in PD (its KV would need forwarding between its stages).

MLA's latent cache (planes 1; `TPLayout` of one KV head, which every rank holds whole): prefill
rank 0 alone ships it, as one frame per layer; decode rank 0 writes it and hands the whole
frame to every other rank. Per token that is 576 x num_layers x itemsize bytes on the wire
once (DeepSeek-V2-Lite, bf16: 27 layers, 30.4 KiB), and the same bytes written into each of the D
decode ranks' pools (D - 1 of them through one broadcast over the device group).

"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from common.engine.tp_link import HAS_LAYER_HOOK, StepDriver
from common.model.parallel import TPLayout
from kv_transfer.base import KVReceiver, KVSender, Transfer, TransferConfig
from kv_transfer.ipc_handles import export_or_refusal, forget_export
from kv_transfer.pool_io import PoolWriter, raw, write_heads

if TYPE_CHECKING:
    from common.engine.worker import Worker

log = logging.getLogger(__name__)


def shipping_ranks(layout: TPLayout) -> list[int]:
    """The ranks that ship KV: the first owner of each KV head."""
    return sorted({layout.kv_head_owners(h)[0] for h in range(layout.num_kv_heads)})


def rank_transfer(
    config: TransferConfig, layout: TPLayout, rank: int, layers: range | None = None, pp: int = 1
) -> TransferConfig | None:
    """The sender config of a prefill rank (`rank` within its stage, whose pool holds
    `layers`), or None when it ships nothing."""
    ranks = shipping_ranks(layout)
    if rank not in ranks:
        return None
    head_start = layout.kv_heads(rank).start
    layer_start = 0 if layers is None else layers.start
    return dataclasses.replace(
        config, head_start=head_start, senders=len(ranks) * pp, layer_start=layer_start
    )


TP_TRANSPORTS = ("zmq", "cuda_ipc")


def check_transport(transport: str, tp: int, pp: int = 1) -> None:
    if tp * pp > 1 and transport not in TP_TRANSPORTS:
        raise ValueError(
            f"transport {transport!r} with tp={tp}, pp={pp}: nodes of several ranks ship KV "
            f"over {' or '.join(TP_TRANSPORTS)}"
        )


class TPSender(KVSender):
    """Rank 0's sender: its own, plus every call mirrored to the other shipping ranks."""

    def __init__(self, local: KVSender, link: StepDriver) -> None:
        self.local, self.link = local, link

    def begin(self, request_id, dest_address, src_block_ids, dst_block_ids) -> Transfer:
        # Rank 0 first: when it refuses (ValueError) no rank begins, so a request rank 0 never
        # began has begun nowhere (what `decline` promises the receiver).
        transfer = self.local.begin(request_id, dest_address, src_block_ids, dst_block_ids)
        self.link.send_command({"op": "begin", "rid": request_id, "dest": dest_address,
                                "src": list(src_block_ids), "dst": list(dst_block_ids)})  # fmt: skip
        return transfer

    def send_layer(self, request_id: str, layer: int) -> None:
        self.local.send_layer(request_id, layer)  # the ranks' hooks send theirs

    def send_layers(self, request_id: str, layers: range) -> None:
        self.link.send_command({"op": "send_layers", "rid": request_id})
        self.local.send_layers(request_id, layers)

    def complete(
        self,
        request_id: str,
        metadata: dict[str, Any],
        payload: torch.Tensor | bytes | None = None,
    ) -> None:
        # The other ranks complete with no metadata and no payload: rank 0's notice carries both.
        self.link.send_command({"op": "complete", "rid": request_id})
        self.local.complete(request_id, metadata, payload)

    def abort(self, request_id: str, reason: str) -> None:
        self.link.send_command({"op": "abort", "rid": request_id, "reason": reason})
        self.local.abort(request_id, reason)

    def decline(self, request_id: str, dest_address: str, reason: str) -> None:
        # cuda_ipc: the receiver frees the blocks once each sending rank promised (zmq: no-op).
        self.link.send_command(
            {"op": "decline", "rid": request_id, "dest": dest_address, "reason": reason}
        )
        self.local.decline(request_id, dest_address, reason)

    def poll(self) -> list[Transfer]:
        return self.local.poll()

    def close(self) -> None:
        self.local.close()


class TPPoolWriter(PoolWriter):
    """Decode rank 0: writes its heads, hands every frame's other heads to the ranks."""

    def __init__(self, pool: torch.Tensor, layout: TPLayout, link: StepDriver) -> None:
        super().__init__(pool, layout.kv_heads(0))
        self.layout, self.link = layout, link
        self._other_heads = frozenset(h for r in range(1, layout.size) for h in layout.kv_heads(r))

    @property
    def num_heads(self) -> int:
        return self.layout.num_kv_heads

    def write(self, layer: int, block_ids: list[int], head_start: int, payload: torch.Tensor):
        write_heads(self.pool, self.heads, layer, block_ids, head_start, payload)
        frame = range(head_start, head_start + payload.shape[3])
        if not self._other_heads.isdisjoint(frame):
            # A received buffer is read-only; float8 goes as bytes (collectives may lack it).
            data = raw(payload.to(self.pool.device, copy=True))
            self.link.send_command({"op": "kv", "layer": layer, "blocks": list(block_ids),
                                    "head_start": head_start, "dtype": str(data.dtype),
                                    "shape": list(data.shape)}, data)  # fmt: skip


class PrefillRank:
    """A prefill rank > 0: mirrors rank 0's sender calls with its own sender."""

    def __init__(self, sender: KVSender | None, layers: range) -> None:
        self.sender, self.layers = sender, layers  # the model layers its pool holds
        self.fresh: list[str] = []  # begun, layers not sent yet

    def command(self, command: dict[str, Any], payload: torch.Tensor | None) -> None:
        if self.sender is None:
            return
        op, rid = command["op"], command["rid"]
        try:
            if op == "begin":
                self.sender.begin(rid, command["dest"], command["src"], command["dst"])
                self.fresh.append(rid)
            elif op == "send_layers":
                self._forget(rid)
                self.sender.send_layers(rid, self.layers)
            elif op == "complete":
                self.sender.complete(rid, {})
                self.sender.flush()  # copies done: rank 0 may reuse the blocks next step
            elif op == "abort":
                self._forget(rid)
                self.sender.abort(rid, command["reason"])
            elif op == "decline":
                self.sender.decline(rid, command["dest"], command["reason"])
        except ValueError:  # this rank's transfer failed already: the receiver was told
            log.exception("KV transfer command %s for %s", op, rid)
        self.sender.poll()

    def _forget(self, rid: str) -> None:
        if rid in self.fresh:
            self.fresh.remove(rid)

    def layer_hook(self, flags: int) -> Callable[[int], None] | None:
        if self.sender is None or not flags & HAS_LAYER_HOOK:
            return None
        shipping, self.fresh = self.fresh, []
        sender = self.sender

        def hook(layer: int) -> None:
            for rid in shipping:
                sender.send_layer(rid, layer)  # only this stage's layers run here

        return hook

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


class DecodeRank:
    """A decode rank > 0: writes the heads its pool holds of every frame rank 0 hands over.
    (cuda_ipc senders write its pool directly: through the export it gave rank 0.)"""

    def __init__(self, pool: torch.Tensor, heads: range, session: str | None = None) -> None:
        self.pool, self.heads = pool, heads
        self.session = session  # of its pool export (cuda_ipc)

    def command(self, command: dict[str, Any], payload: torch.Tensor | None) -> None:
        if command["op"] == "kv" and payload is not None:
            write_heads(self.pool, self.heads, command["layer"], command["blocks"],
                        command["head_start"], payload)  # fmt: skip

    def layer_hook(self, flags: int) -> None:
        return None

    def close(self) -> None:
        if self.session is not None:
            forget_export(self.session)


def prefill_rank_handler(transfer: TransferConfig, worker: Worker) -> PrefillRank:
    """The handler of a prefill node's rank > 0 (`RankRole.make_handler`, bound to the
    node's transfer config with `functools.partial`)."""
    layout, rank = worker.tp.layout(worker.spec), worker.tp.rank
    from kv_transfer import create_sender

    # Injected failures (tests) are rank 0's: it aborts, and the ranks follow. Each shipping
    # rank announces its own pool's format.
    transfer = dataclasses.replace(transfer, fail_rate=0.0, kv_format=worker.runtime.kv_format)
    layers, pp = worker.kv_cache.layers, worker.config.pp
    config = rank_transfer(transfer, layout, rank, layers, pp)
    pool = worker.kv_cache.pool
    sender = create_sender(config, pool) if config is not None else None
    return PrefillRank(sender, layers)


def decode_rank_handler(transport: str, worker: Worker) -> DecodeRank:
    """The handler of a decode node's rank > 0 (`RankRole.make_handler`, bound to the node's
    transport with `functools.partial`). cuda_ipc: hands rank 0 its pool export first."""
    pool, session = worker.kv_cache.pool, None
    if transport == "cuda_ipc":
        session = secrets.token_hex(8)
        worker.tp.all_gather_object(export_or_refusal(pool, session))  # with tp_receiver's
    return DecodeRank(pool, worker.tp.layout(worker.spec).kv_heads(worker.tp.rank), session)


def tp_receiver(receiver: KVReceiver, worker: Worker, transport: str) -> None:
    """Rank 0 of a decode node of several ranks, before any expect(): `receiver` writes every
    frame's heads into the ranks' pools (`TPPoolWriter`); cuda_ipc: it also answers senders
    with every rank's pool export, collected from the ranks (their `decode_rank_handler`)."""
    assert worker.runner.link is not None  # rank 0 of several
    layout, pool = worker.tp.layout(worker.spec), worker.kv_cache.pool
    receiver.set_writer(TPPoolWriter(pool, layout, worker.runner.link))  # type: ignore[attr-defined]
    if transport == "cuda_ipc":
        exports = worker.tp.all_gather_object(receiver.pool_export)  # type: ignore[attr-defined]
        heads = [layout.kv_heads(r) for r in range(layout.size)]
        receiver.share_ranks(exports, heads)  # type: ignore[attr-defined]
