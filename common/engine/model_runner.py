"""Turns a ScheduledBatch into tensors, runs the model, samples one token per finishing row.

`launch` queues one step and returns a `StepHandle` at once: the sampled ids stay on the device
(the next step reads its placeholder inputs from them) and one non-blocking copy plus an event
bring them to the host for `StepHandle.result`. Tensor parallel (`common.engine.tp_link`): rank
0's runner has a `link` and broadcasts each step's `HostInputs` and then its sampled ids; the
other ranks `follow` with the same forward, without sampling.

Pipeline parallel (`pipe`): every stage's runner runs its own layers. Stage 0's `launch`
passes its (hidden, residual) rows to stage 1 (asynchronous sends) and posts the receive of the
step's logits rows from the last stage; sampling waits for them in `StepHandle.result`, so
stage 0 can launch the next step while later stages still run this one. A stage after the
first `follow`s: it receives its carry, runs its layers, and passes the carry on or, the last,
sends the logits rows to rank 0. No stage reads an unresolved token (`EngineCore`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.engine.cuda_graphs import DecodeGraphs, Replay
from common.engine.device_copy import to_device
from common.engine.kv_cache import KVCache
from common.engine.logits_processors import LogitsProcessors
from common.engine.prefill_graphs import PrefillGraphs
from common.engine.prompt_logprobs import PromptRows, collect, prompt_rows
from common.engine.sampler import (
    Sampler,
    SamplingInputs,
)
from common.engine.scheduler import SampledToken, ScheduledBatch, ScheduledSeq
from common.engine.sequence import PLACEHOLDER, Sequence
from common.engine.step_handle import StepHandle
from common.model.attention import AttentionBackend, AttentionMetadata, ForwardContext
from common.model.registry import CausalLM

if TYPE_CHECKING:
    from common.engine.tp_link import StepDriver
    from common.model.distributed import PipeGroup

Carry = tuple[torch.Tensor, torch.Tensor]  # (hidden, residual) rows between pipeline stages

Fill = tuple[torch.Tensor, torch.Tensor] | None  # (token positions, device ids) to overwrite


@dataclass
class HostInputs:
    """One step's inputs as plain lists, before they become tensors or graph buffers."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    row_keys: list[tuple] = field(default_factory=list)  # see DecodeGraphs.launch
    logits_indices: list[int] = field(default_factory=list)  # token index of each sampling row
    sample_rows: list[int] = field(default_factory=list)  # batch item index of each sampling row
    # Tokens not on the host yet: (token index here, row of the previous step's sampled ids).
    fill_at: list[int] = field(default_factory=list)
    fill_from: list[int] = field(default_factory=list)
    verify: bool = False  # some item verifies drafts: each of its tokens is a sampling row
    # Per row: n on the first of a verify run's n rows, 0 on its others, 1 elsewhere
    # (`AttentionMetadata.decode_groups`).
    groups: list[int] = field(default_factory=list)
    # Rows whose prompt logprobs are collected (rank 0 only: not sent to the other ranks).
    prompt_rows: list[PromptRows] = field(default_factory=list)

    @property
    def is_decode_only(self) -> bool:
        # Every row has at least one token: as many tokens as rows means one each.
        return len(self.input_ids) == len(self.query_lens) == len(self.logits_indices)


# From this many blocks numpy builds a run's slots: on a 2-core CI-like CPU 16 blocks took 31
# against 10 us, 128 (2048 positions, 16 a block) 185 against 80; 8 blocks 12 against 14.
NUMPY_SLOTS_MIN_BLOCKS = 16


def slots(blocks: list[int], block_size: int, start: int, end: int) -> list[int]:
    """The KV slots of positions [start, end) of a sequence with `blocks`: a block's run of
    positions at a time (8192 positions: one list per 16, not one expression per position),
    or for long runs every block's row of slots at once in numpy."""
    first, last = start // block_size, (end - 1) // block_size
    if last - first + 1 >= NUMPY_SLOTS_MIN_BLOCKS:
        rows = np.asarray(blocks[first : last + 1], dtype=np.int64)[:, None] * block_size
        offset = start - first * block_size
        flat = (rows + np.arange(block_size)).ravel()
        return flat[offset : offset + end - start].tolist()
    out: list[int] = []
    for i in range(first, last + 1):
        shift = (blocks[i] - i) * block_size  # slot - position, within block i
        out += range(max(start, i * block_size) + shift, min(end, (i + 1) * block_size) + shift)
    return out


def block_table_key(seq: Sequence) -> tuple[str, int, int, int]:
    """Changes whenever the sequence's block list changes other than by growing: another
    sequence, a preemption, or blocks of rejected drafts given back (`DecodeGraphs.launch`
    rewrites a staged row only when its key changes)."""
    return (seq.request_id, seq.num_preemptions, seq.num_block_trims, len(seq.block_ids))


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        backend: AttentionBackend,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.block_size = kv_cache.block_size
        self.scale = model.spec.attention_scale
        self.sampler = Sampler(model.spec.vocab_size, device)
        self.eos_token_ids = list(model.spec.eos_token_ids)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        # Grammar masks and logit_bias, applied just before sampling (set by the Worker).
        self.logits_processors: LogitsProcessors | None = None
        self._k_caches = kv_cache.k_caches
        self._v_caches = kv_cache.v_caches
        self._kv_scales = kv_cache.context_kwargs()  # FP8 pools only
        self.link: StepDriver | None = None  # rank 0 of several: drives the other ranks
        self.pipe: PipeGroup | None = None  # pipeline parallel: this stage's links
        self._sends: list[tuple[object, tuple[torch.Tensor, ...]]] = []  # (work, its tensors)
        # EAGLE-3: called after every forward with each item's (request id, first position,
        # rows) and the target's auxiliary hidden states of those rows.
        self.aux_observer: Callable[..., None] | None = None

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, rows_max: int = 1) -> int:
        """Capture decode graphs (on CPU: set up their buffers, replays run eagerly); returns
        the bytes they hold. `rows_max`: most decode rows of one sequence (K + 1 with
        speculation), whose verify runs the graphs' attention then reads once."""
        self.graphs = DecodeGraphs(
            self.model, self.backend, self.kv_cache, max_num_seqs, max_model_len, self.scale,
            rows_max,
        )  # fmt: skip
        return self.graphs.capture()

    def capture_prefill_graphs(self, max_tokens: int) -> int:
        """Capture piecewise graphs for prefill and mixed steps of up to `max_tokens` tokens
        (on CPU: set up their buffers, steps run the same data flow eagerly); returns bytes."""
        self.prefill_graphs = PrefillGraphs(
            self.model, self.backend, self.kv_cache, max_tokens, self.scale
        )
        return self.prefill_graphs.capture()

    def release(self, request_id: str) -> None:
        """Forget per-request sampler state (noise key, token counts) once it has ended."""
        self.sampler.release(request_id)
        if self.logits_processors is not None:
            self.logits_processors.release(request_id)

    def host_inputs(self, batch: ScheduledBatch, prev: StepHandle | None = None) -> HostInputs:
        """`prev`: the step launched before this one, whose sampled ids may not be on the host
        yet; a decode row whose input is still a placeholder reads it from there."""
        bs = self.block_size
        h = HostInputs()
        prev_rows = prev.sampled_row() if prev is not None else {}
        for row, item in enumerate(batch.items):
            seq, start, n = item.seq, item.start, item.num_new_tokens
            drafts = batch.drafts_of(row)
            if drafts:
                self._verify_rows(h, row, item, drafts)
                continue
            if n == 1:
                token = seq.token_at(start)
                if token == PLACEHOLDER:
                    h.fill_at.append(len(h.input_ids))
                    h.fill_from.append(prev_rows[seq.request_id])
                    token = 0
                h.input_ids.append(token)
            else:
                tokens = seq.all_token_ids[start : start + n]
                assert PLACEHOLDER not in tokens, "a multi-token row with an unresolved token"
                h.input_ids.extend(tokens)
            h.positions.extend(range(start, start + n))
            blocks = seq.block_ids
            if n == 1:
                h.slots.append(blocks[start // bs] * bs + start % bs)
            else:
                h.slots += slots(blocks, bs, start, start + n)
            h.query_lens.append(n)
            h.seq_lens.append(start + n)
            h.block_tables.append(blocks)
            h.groups.append(1)
            h.row_keys.append(block_table_key(seq))
            if item.samples:
                h.logits_indices.append(len(h.input_ids) - 1)
                h.sample_rows.append(row)
        return h

    def _verify_rows(self, h: HostInputs, row: int, item: ScheduledSeq, drafts: list[int]) -> None:
        """A speculating item: its last token and its drafts as decode rows, row j at position
        start + j attending to the KV up to there (written by this same forward, before any
        attention reads it), each a sampling row."""
        bs, seq, start = self.block_size, item.seq, item.start
        blocks = seq.block_ids
        key = block_table_key(seq)
        h.verify = True
        h.sample_rows.append(row)
        m, first = 1 + len(drafts), len(h.input_ids)
        positions = range(start, start + m)
        h.input_ids.append(seq.token_at(start))
        h.input_ids += drafts
        h.positions += positions
        h.slots += slots(blocks, bs, start, start + m)
        h.query_lens += [1] * m
        h.seq_lens += range(start + 1, start + m + 1)
        h.block_tables += [blocks] * m
        h.groups += [m] + [0] * (m - 1)
        h.row_keys += [(*key, j) for j in range(m)]
        h.logits_indices += range(first, first + m)

    def _tensor(self, values, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, self.device)

    def metadata(self, h: HostInputs) -> AttentionMetadata:
        width = max(len(t) for t in h.block_tables)
        cum = [0]
        for n in h.query_lens:
            cum.append(cum[-1] + n)
        # Eager steps group only verify runs: a step without one keeps the plain launch.
        rows_max = max(h.groups, default=1)
        return AttentionMetadata(
            query_start_loc=self._tensor(cum, torch.int32),
            seq_lens=self._tensor(h.seq_lens, torch.int32),
            block_tables=self._tensor(
                [t + [0] * (width - len(t)) for t in h.block_tables], torch.int32
            ),
            slot_mapping=self._tensor(h.slots, torch.int64),
            query_lens_cpu=h.query_lens,
            seq_lens_cpu=h.seq_lens,
            max_query_len=max(h.query_lens),
            max_seq_len=max(h.seq_lens),
            decode_groups=self._tensor(h.groups, torch.int32) if rows_max > 1 else None,
            decode_rows_max=rows_max,
        )

    @torch.inference_mode()
    def execute(
        self, batch: ScheduledBatch, on_layer_done: Callable[[int], None] | None = None
    ) -> list[SampledToken | None]:
        """Run one step and wait for it; one entry per batch item (None where no token is
        sampled)."""
        return self.launch(batch, on_layer_done=on_layer_done).result()

    @torch.inference_mode()
    def launch(
        self,
        batch: ScheduledBatch,
        prev: StepHandle | None = None,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> StepHandle:
        """Queue one step (model and sampling) on the device without waiting for it. Must be
        called before the scheduler commits the step: sampling reads each row's output length
        as its draw index."""
        h = self.host_inputs(batch, prev)
        h.prompt_rows = prompt_rows(batch)
        handle = StepHandle(batch, h.sample_rows)
        fill = None
        if h.fill_at:
            assert prev is not None and prev.token_ids is not None
            fill = self._fill(h, prev.token_ids)
        if self.link is not None:
            self.link.send_step(h, int(on_layer_done is not None))
        if not self.model.stage.is_last:
            assert fill is None, "a pipelined step read an unresolved token"
            handle.replay, carry = self._forward(h, None, on_layer_done)
            self._launch_pipelined(handle, h, batch, carry)
            return handle
        handle.replay, logits = self._forward(h, fill, on_layer_done)
        if self.aux_observer is not None:
            self._observe(batch, handle.replay)
        try:
            self._sample(handle, batch, logits)
        except BaseException:
            if handle.replay is not None:  # give the staging slot back: nothing reads it now
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                handle.replay.release()
            raise
        finally:
            if self.link is not None:
                ids = handle.token_ids
                if ids is not None and ids.dim() == 2:  # verify: the first emitted token
                    ids = ids[:, 0]
                self.link.send_ids(ids, len(h.sample_rows))
        return handle

    def _launch_pipelined(
        self, handle: StepHandle, h: HostInputs, batch: ScheduledBatch, carry: Carry
    ) -> None:
        """Stage 0 of several: pass the carry on; sample once the logits arrive."""
        if self.pipe is None:
            return  # a memory probe of a stage's layers: nothing to pass on or sample
        self._pass_on(carry, copy=handle.replay is not None)
        if not h.sample_rows:
            handle.mark_launched()  # `result` releases the staging slot after stage 0's part
            return
        rows = len(h.logits_indices)
        logits = torch.empty(rows, self.model.spec.vocab_size, dtype=torch.float32,
                             device=self.device)  # fmt: skip
        work = self.pipe.recv_from_last(logits)

        def finish() -> None:
            work.wait()
            self._sample(handle, batch, logits)

        handle.finish = finish

    def _pass_on(self, tensors: tuple[torch.Tensor, ...], copy: bool, logits: bool = False):
        """Send to the next stage (`logits`: the last stage's rows, to rank 0). `copy`: the
        tensors are a graph's static buffers, which the next replay rewrites while the send
        may still read them."""
        if copy:
            tensors = tuple(t.clone() for t in tensors)
        tensors = tuple(t.contiguous() for t in tensors)
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        if logits:
            self._sends.append((self.pipe.send_to_driver(tensors[0]), tensors))
        else:
            self._sends += [(w, tensors) for w in self.pipe.send_next(list(tensors))]

    def _receive_carry(self, rows: int) -> Carry:
        shape = (rows, self.model.spec.hidden_size)
        hidden = torch.empty(shape, dtype=self.model.dtype, device=self.device)
        residual = torch.empty_like(hidden)
        self.pipe.recv_prev([hidden, residual])
        return hidden, residual

    def wait_sends(self) -> None:
        """Block until every send to another stage has left (before exiting)."""
        for work, _ in self._sends:
            work.wait()
        self._sends = []

    @torch.inference_mode()
    def follow(
        self,
        h: HostInputs,
        prev_ids: torch.Tensor | None,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> Replay | None:
        """A rank > 0: run the forward rank 0 announced (`prev_ids`: the previous step's
        sampled ids, for placeholder tokens). The caller releases the returned replay's
        staging slot once the step has run. A later pipeline stage first receives its carry,
        then passes its own on, or (the last stage's leader) sends the logits rows."""
        fill = self._fill(h, prev_ids) if h.fill_at else None
        stage = self.model.stage
        carry = None if self.pipe is None or stage.is_first else self._receive_carry(len(h.slots))
        replay, out = self._forward(h, fill, on_layer_done, carry)
        if self.pipe is not None:
            if not stage.is_last:
                self._pass_on(out, copy=replay is not None)
            elif self.pipe.tp_rank == 0 and h.sample_rows:
                self._pass_on((out,), copy=replay is not None, logits=True)
        return replay

    def _observe(self, batch: ScheduledBatch, replay: Replay | None) -> None:
        aux = replay.aux_hidden if replay is not None else self.model.model.aux_hidden
        counts = [
            1 + len(batch.drafts_of(row)) if batch.drafts_of(row) else item.num_new_tokens
            for row, item in enumerate(batch.items)
        ]
        ids = [item.seq.request_id for item in batch.items]
        self.aux_observer(ids, [item.start for item in batch.items], counts, aux)

    def _fill(self, h: HostInputs, prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        at, src = self._tensor([h.fill_at, h.fill_from], torch.int64)  # one copy to the device
        return at, prev_ids.index_select(0, src)

    def _forward(
        self,
        h: HostInputs,
        fill: Fill,
        on_layer_done: Callable[[int], None] | None,
        carry: Carry | None = None,
    ) -> tuple[Replay | None, torch.Tensor | Carry | None]:
        """(the replay whose staging slot the step uses, or None; the sampling rows' logits,
        or a pipeline stage before the last: its carry)."""
        if carry is None and not self.model.stage.is_first:
            carry = self._zero_carry(len(h.slots))  # a memory probe of a later stage
        last = self.model.stage.is_last
        if (
            self.graphs is not None
            and on_layer_done is None
            and h.is_decode_only
            and self.graphs.fits(len(h.slots))
        ):
            replay = self.graphs.launch(
                h.input_ids, h.positions, h.slots, h.seq_lens, h.block_tables, h.row_keys, fill,
                h.groups, carry,
            )  # fmt: skip
            return replay, replay.output if last else replay.carry
        if (
            self.prefill_graphs is not None
            and not h.is_decode_only
            and self.prefill_graphs.fits(len(h.slots))
        ):
            replay = self.prefill_graphs.launch(
                h.input_ids, h.positions, self.metadata(h), fill, on_layer_done, carry
            )
            return replay, self._logits(h, replay.output) if last else replay.carry
        return None, self._eager(h, fill, on_layer_done, carry)

    def _zero_carry(self, rows: int) -> Carry:
        shape = (rows, self.model.spec.hidden_size)
        hidden = torch.zeros(shape, dtype=self.model.dtype, device=self.device)
        return hidden, torch.zeros_like(hidden)

    def _sample(self, handle: StepHandle, batch: ScheduledBatch, logits) -> None:
        if handle.sample_rows:
            seqs = [batch.items[row].seq for row in handle.sample_rows]
            if batch.speculates:
                self._verify(handle, batch, seqs, logits)
                return
            if self.logits_processors is not None:
                logits = self.logits_processors.apply(logits, seqs)
            plan = self.sampler.plan(self._sampling_inputs(seqs), tuple(logits.shape))
            handle.set_sampled(self.sampler.sample(logits, plan), plan)

    def _sampling_inputs(self, seqs: list[Sequence]) -> SamplingInputs:
        return SamplingInputs(
            params=[s.params for s in seqs],
            prompt_token_ids=[s.prompt_token_ids for s in seqs],
            output_token_ids=[s.output_token_ids for s in seqs],
            eos_token_ids=[self.eos_token_ids] * len(seqs),
            request_ids=[s.request_id for s in seqs],
        )

    def _verify(self, handle: StepHandle, batch: ScheduledBatch, seqs, logits) -> None:
        """Accept a prefix of each item's drafts plus one token of the target's own
        (`Sampler.verify`); items without drafts sample one token as usual."""
        drafts = [batch.drafts_of(row) for row in handle.sample_rows]
        if self.logits_processors is not None:
            logits = self.logits_processors.apply_drafts(logits, seqs, drafts)
        inputs = self._sampling_inputs(seqs)
        plan = self.sampler.plan_verify(inputs, drafts, tuple(logits.shape))
        handle.set_verified(self.sampler.verify(logits, plan, batch.draft_probs), plan)

    def _eager(
        self,
        h: HostInputs,
        fill: tuple[torch.Tensor, torch.Tensor] | None,
        on_layer_done: Callable[[int], None] | None,
        carry: Carry | None = None,
    ) -> torch.Tensor | Carry | None:
        ctx = ForwardContext(
            self.backend,
            self.metadata(h),
            self._k_caches,
            self._v_caches,
            self.scale,
            on_layer_done,
            **self._kv_scales,
        )
        input_ids = self._tensor(h.input_ids, torch.int64)
        if fill is not None:
            input_ids.index_copy_(0, *fill)
        out = self.model(input_ids, self._tensor(h.positions, torch.int64), ctx, carry)
        return self._logits(h, out) if self.model.stage.is_last else out

    def _logits(self, h: HostInputs, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits of the sampling rows of `hidden` (one row per token); first the
        prompt logprobs of `h.prompt_rows` (never in a decode-only step: a prompt token's
        row there is the prompt's last, whose logits sample)."""
        if h.prompt_rows:
            collect(self.model, hidden, h.prompt_rows)
        if not h.sample_rows:
            return None
        return self.model.compute_logits(hidden[self._tensor(h.logits_indices, torch.int64)])
