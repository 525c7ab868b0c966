"""How rank 0 drives the other tensor-parallel ranks of a node, one step at a time.

Before each step rank 0 broadcasts its `HostInputs` packed into one int64 tensor over the gloo
`cpu_group` (no pickling, a few KB); every rank runs the same forward, so collectives pair up.
Only rank 0 samples; it broadcasts the sampled ids over the device group, where each rank fills
the next step's placeholder tokens from them.

Packed step: header `[STEP, tokens, rows, samples, fills, table entries, flags, 0]`, then
input_ids, positions, slots (per token); query_lens, seq_lens, row keys, table lengths, groups
(per row); the block tables, concatenated; logits_indices, sample_rows (per sampled row); fill_at,
fill_from (per placeholder). Row keys are hashes of rank 0's `(request id, preemptions,
blocks)` keys: equal hash, equal row (see `DecodeGraphs.launch`).

Pipeline parallel (`common.model.distributed.PipeGroup`): the same messages also travel stage
to stage, leader to leader, over gloo point-to-point sends (asynchronous); each stage's leader
re-broadcasts them to its own tensor-parallel ranks and passes them on, so every process sees
every step and command in one order. There are no sampled ids to share then: no step of a
pipelined node reads a token before it is on the host (`EngineCore`).

Between steps rank 0 may send a command (`kv_transfer.tp`: KV transfer calls a prefill rank
mirrors, KV heads a decode rank writes): header `[COMMAND, bytes, payload rows, 0...]`, a
msgpack map as a uint8 tensor, then an optional payload tensor over the device group. Commands
are rare (per request, not per step) and carry strings (request ids, addresses).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import msgpack
import torch

from common.engine.model_runner import HostInputs
from common.model.distributed import PipeGroup, TPGroup

STEP, STOP, COMMAND = 1, 2, 3
HEADER = 8
HAS_LAYER_HOOK = 1  # flags: rank 0 runs this step with a per-layer hook (the same path here)


def pack(h: HostInputs, flags: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    lens = [len(t) for t in h.block_tables]
    header = [STEP, len(h.input_ids), len(h.query_lens), len(h.logits_indices), len(h.fill_at)]
    header += [sum(lens), flags, len(h.sample_rows)]
    keys = [hash(k) for k in h.row_keys]
    body = [*h.input_ids, *h.positions, *h.slots, *h.query_lens, *h.seq_lens, *keys, *lens]
    body += h.groups
    for table in h.block_tables:
        body += table
    body += [*h.logits_indices, *h.sample_rows, *h.fill_at, *h.fill_from]
    return torch.tensor(header, dtype=torch.int64), torch.tensor(body, dtype=torch.int64)


def body_size(header: list[int]) -> int:
    """Entries of the body `pack` sends after `header`."""
    _, tokens, rows, logits_rows, fills, entries, _, samples = header
    return 3 * tokens + 5 * rows + entries + logits_rows + samples + 2 * fills


def unpack(header: list[int], body: torch.Tensor) -> tuple[HostInputs, int]:
    _, tokens, rows, logits_rows, fills, _, flags, samples = header
    values = body.tolist()
    sizes = [tokens] * 3 + [rows] * 5
    cuts = list(accumulate(sizes, initial=0))
    parts = [values[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    ids, positions, slots, query_lens, seq_lens, keys, lens, groups = parts
    at = cuts[-1]
    tables = []
    for n in lens:
        tables.append(values[at : at + n])
        at += n
    # A verify step has more logits rows (one per drafted token) than sampled items.
    tail = [values[at : at + logits_rows], values[at + logits_rows : at + logits_rows + samples]]
    at += logits_rows + samples
    fill_at, fill_from = values[at : at + fills], values[at + fills : at + 2 * fills]
    h = HostInputs(ids, positions, slots, query_lens, seq_lens, tables, keys, *tail)
    h.fill_at, h.fill_from, h.groups = fill_at, fill_from, groups
    return h, flags


class StepDriver:
    """Rank 0's side (and a later stage's leader, relaying): announce each step, then share
    its sampled ids."""

    def __init__(self, tp: TPGroup, device: torch.device, pipe: PipeGroup | None = None) -> None:
        self.tp, self.device, self.pipe = tp, device, pipe
        self._sends: list[tuple[Any, torch.Tensor]] = []  # to the next stage, not yet done

    def announce(self, t: torch.Tensor) -> None:
        """`t` (host) to this stage's other ranks, then to the next stage's leader."""
        if self.tp.size > 1:
            self.tp.broadcast(t, cpu=True)
        if self.pipe is not None and not self.pipe.is_last:
            self._sends = [(w, x) for w, x in self._sends if not w.is_completed()]
            self._sends += [(w, t) for w in self.pipe.send_next([t], cpu=True)]

    def send_step(self, h: HostInputs, flags: int = 0) -> None:
        header, body = pack(h, flags)
        self.announce(header)
        self.announce(body)

    def send_ids(self, token_ids: torch.Tensor | None, rows: int) -> None:
        """Every step with sampled rows sends exactly `rows` ids, zeros when sampling failed,
        so the ranks' collectives stay paired (a pipelined node shares none)."""
        if rows == 0 or self.pipe is not None:
            return
        if token_ids is None:
            token_ids = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.tp.broadcast(token_ids.to(torch.int64).contiguous())

    def stop(self) -> None:
        self.announce(torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.int64))
        self.flush()

    def flush(self) -> None:
        """Wait until the next stage has everything announced so far."""
        for work, _ in self._sends:
            work.wait()
        self._sends = []

    def send_command(self, command: dict[str, Any], payload: torch.Tensor | None = None) -> None:
        """`payload`: a tensor of the model's device (its dtype and shape go in `command`);
        commands with one stay within the stage (a decode rank's KV heads)."""
        data = msgpack.packb(command, use_bin_type=True)
        rows = 0 if payload is None else 1
        if rows and self.pipe is not None:
            raise ValueError("a command with a payload cannot cross pipeline stages")
        header = torch.tensor([COMMAND, len(data), rows] + [0] * (HEADER - 3), dtype=torch.int64)
        self.announce(header)
        self.announce(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if payload is not None:
            self.tp.broadcast(payload.contiguous())


Command = tuple[dict[str, Any], torch.Tensor | None]  # (map, payload)


class StepFollower:
    """A rank > 0: receive each step, run the same forward, receive the sampled ids. A later
    pipeline stage's leader receives from the stage before and relays (`StepDriver`)."""

    def __init__(self, tp: TPGroup, device: torch.device, pipe: PipeGroup | None = None) -> None:
        self.tp, self.device, self.pipe = tp, device, pipe
        self.relay: StepDriver | None = None
        if pipe is not None and not pipe.is_first and tp.rank == 0:
            self.relay = StepDriver(tp, device, pipe)

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """The next host message into `t`: from the previous stage (relayed on), or from this
        stage's leader."""
        if self.relay is None:
            return self.tp.broadcast(t, cpu=True)
        self.pipe.recv_prev([t], cpu=True)
        self.relay.announce(t)
        return t

    def receive(self) -> tuple[HostInputs, int] | Command | None:
        """The next step `(inputs, flags)`, a command `(map, payload)`, or None: stop."""
        header = self._host(torch.zeros(HEADER, dtype=torch.int64)).tolist()
        if header[0] == STOP:
            if self.relay is not None:
                self.relay.flush()  # the STOP it passed on has left
            return None
        if header[0] == COMMAND:
            return self._command(header[1], header[2])
        body = self._host(torch.zeros(body_size(header), dtype=torch.int64))
        return unpack(header, body)

    def _command(self, nbytes: int, rows: int) -> Command:
        data = self._host(torch.zeros(nbytes, dtype=torch.uint8))
        command = msgpack.unpackb(data.numpy().tobytes(), raw=False)
        payload = None
        if rows:
            dtype = getattr(torch, command["dtype"].removeprefix("torch."))
            payload = torch.empty(command["shape"], dtype=dtype, device=self.device)
            self.tp.broadcast(payload)
        return command, payload

    def receive_ids(self, rows: int) -> torch.Tensor | None:
        if rows == 0 or self.pipe is not None:
            return None
        return self.tp.broadcast(torch.zeros(rows, dtype=torch.int64, device=self.device))
