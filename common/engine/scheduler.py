"""Continuous-batching scheduler (pure Python, no torch).

Per step, within a token budget: running sequences first, then waiting ones in arrival order.
Blocks are allocated just before the step that fills them; when the pool runs dry the most
recently arrived running sequence is preempted (blocks freed, recomputed later, usually from
the prefix cache). Nothing here can fail for lack of memory.

Block ownership: the scheduler frees a sequence's blocks when it finishes, is aborted or is
preempted, except in `prefill_only` mode, where a sequence that sampled its first token leaves
with its blocks: the prefill node keeps them until the KV has been shipped, then frees them.

After the model: `update` = `commit` (placeholder tokens) then `resolve` (sampled ids, stop
rules); the overlapped loop (`EngineCore`) calls them one step apart. While a step is in flight
(`hold_frees`), blocks of sequences that finish or are aborted are held back (`take_held`)
until it completes, so nothing can reuse a block the running step writes.

Speculative decoding (`num_speculative_tokens` > 0): a decode item may also verify up to that
many drafted tokens (`ScheduledBatch.spec_limits`; the engine's proposer fills
`ScheduledBatch.drafts`). It gets blocks for them only when the pool has them without
preempting anyone, and none in a step with more than `speculative_max_batch` running
sequences. `resolve` then appends every emitted token (stop rules token by token), counts only
verified positions as computed, and frees the blocks that held nothing but rejected drafts:
block tables and the prefix cache never hold an unverified token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from common.engine.block_allocator import BlockAllocator, compute_block_hashes, hash_block_tokens
from common.engine.config import SchedulerConfig
from common.engine.sequence import PLACEHOLDER, FinishReason, Sequence, SequenceStatus
from common.engine.spec_decode.stats import SpecStats
from common.protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (== seq.num_computed_tokens when scheduled)
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so a token is sampled."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass
class ScheduledBatch:
    items: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Set by `Scheduler.commit`: per item, the output position its sampled token fills.
    output_index: list[int | None] = field(default_factory=list)
    # Speculative decoding, per item: how many tokens it may draft (blocks are reserved for
    # them; empty: none may), and the drafts the step verifies after its last token (set by
    # the engine from its proposer; empty: none), with their distributions (`Drafts.probs`).
    spec_limits: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    draft_probs: Any = None

    def drafts_of(self, row: int) -> list[int]:
        return self.drafts[row] if self.drafts else []

    @property
    def speculates(self) -> bool:
        return any(self.drafts)

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: BlockAllocator,
        prefill_only: bool = False,
        num_speculative_tokens: int = 0,
        speculative_max_batch: int = 0,
    ) -> None:
        """`prefill_only` (prefill node): a sequence leaves the scheduler as soon as its first
        token is sampled, keeping its blocks for the KV transfer; the caller frees them.
        `num_speculative_tokens`: most tokens a decode item may draft per step, in steps of at
        most `speculative_max_batch` running sequences."""
        self.config = config
        self.num_speculative_tokens = 0 if prefill_only else num_speculative_tokens
        self.speculative_max_batch = speculative_max_batch
        self.allocator = allocator
        self.prefill_only = prefill_only
        self.block_size = allocator.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Sequences whose KV is already in their blocks (decode node, after a transfer), in
        # arrival order, waiting for a place among at most max_num_seqs running ones.
        self.ready: deque[Sequence] = deque()
        self.num_preemptions = 0  # since start (a node reports it)
        self.spec_totals = SpecStats()  # every sequence's drafted and accepted tokens
        self.hold_frees = False  # a step is in flight: finished sequences' blocks wait
        self._held: list[int] = []

    # -- admission and removal ------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        needed = self.blocks_for(seq.num_tokens + 1)
        if needed > self.allocator.num_blocks:
            raise ValueError(
                f"request {seq.request_id!r} needs {needed} KV blocks, the pool has {self.allocator.num_blocks}"
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and seq.max_model_len > budget:
            # Unsplittable: a prompt, or a preempted sequence's recompute, longer than one step's
            # budget would block the queue forever (the worker caps max_model_len to prevent it).
            raise ValueError(
                f"request {seq.request_id!r} may grow to {seq.max_model_len} tokens, more than "
                f"max_num_batched_tokens={budget}, and chunked prefill is off"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose KV is already in its blocks (decode node, after transfer).

        It joins the running set at the next `schedule()` that has room under max_num_seqs,
        before any waiting sequence; until then it keeps its blocks. (A decode node fed by
        several prefill nodes must not grow past max_num_seqs: its decode steps would leave
        the captured CUDA graphs, which stop at that size.)"""
        assert seq.block_ids and seq.num_computed_tokens > 0
        self.ready.append(seq)

    def fork(self, parent: Sequence, index: int, params: SamplingParams) -> Sequence:
        """Sample `index` of `parent`'s request (n > 1), sharing its prompt's KV blocks.

        Call once the parent's prompt KV is complete (or after `schedule` of the step that
        completes it) and before the parent can free its blocks. The child takes one reference
        on each full prompt block before the last token (it frees them like its own) and
        computes only the rest of the prompt in its next step. No KV is copied.
        """
        n_prompt = len(parent.prompt_token_ids)
        shared = min((n_prompt - 1) // self.block_size, len(parent.block_ids))
        child = Sequence(
            f"{parent.group}#{index}",
            parent.prompt_token_ids,
            params,
            parent.eos_token_ids,
            max_model_len=parent.max_model_len,
            group_id=parent.group,
            index=index,
        )
        if shared == 0:
            self.add(child)  # nothing to share: a prompt shorter than one block + 1 token
            return child
        child.block_ids = parent.block_ids[:shared]
        self.allocator.incref(child.block_ids)
        child.num_computed_tokens = shared * self.block_size
        child.num_registered_blocks = shared  # the parent registers (or registered) them
        self.add_running(child)
        return child

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.running, self.ready, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, FinishReason.ABORT)
                    return seq
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.ready)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        while self.ready and len(self.running) < self.config.max_num_seqs:
            seq = self.ready.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        scheduled: set[str] = set()
        speculate = self._speculates(len(self.running))
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.awaiting_last_token or (self.prefill_only and seq.output_token_ids):
                # Ends when its in-flight token resolves (a prefill_only sequence leaves with
                # its first token: a pipelined node may schedule before it resolved).
                i += 1
                continue
            num_new = min(seq.num_pending_tokens, budget)
            if not self._grow(seq, num_new, batch, scheduled):
                continue  # seq itself was preempted; self.running shrank
            limit = self._spec_limit(seq, budget - num_new) if speculate else 0
            batch.items.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
            batch.spec_limits.append(limit)
            scheduled.add(seq.request_id)
            budget -= num_new + limit
            i += 1
        if batch.preempted:
            if not any(batch.spec_limits):
                batch.spec_limits = []
            return batch  # memory is short: admit nothing new this step
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            lookup = self._attach_cached_prefix(seq) if not seq.block_ids else None
            num_new = seq.num_pending_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                self._release_blocks(seq)
                break
            num_new = min(num_new, budget)
            extra = self.blocks_for(seq.num_computed_tokens + num_new) - len(seq.block_ids)
            blocks = self.allocator.allocate(extra)
            if blocks is None:
                self._release_blocks(seq)
                break
            seq.block_ids.extend(blocks)
            if lookup is not None:  # admitted: now the lookup counts (once per admission)
                self.allocator.record_prefix_lookup(*lookup)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.items.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
            batch.spec_limits.append(0)
            budget -= num_new
        if not any(batch.spec_limits):
            batch.spec_limits = []
        return batch

    def may_speculate(self) -> bool:
        """The next `schedule` may give drafts (its running set will be small enough): the
        engine then runs it synchronously, every token on the host for the proposer."""
        room = max(0, self.config.max_num_seqs - len(self.running))
        return self._speculates(len(self.running) + min(len(self.ready), room))

    def _speculates(self, num_running: int) -> bool:
        return self.num_speculative_tokens > 0 and 0 < num_running <= self.speculative_max_batch

    def _spec_limit(self, seq: Sequence, budget: int) -> int:
        """How many tokens a decode item may draft this step: within K, the token budget, its
        max_tokens (every emitted token but the last may be a draft) and the context limit,
        and blocks the pool has without preempting anyone (reserved here)."""
        if seq.num_pending_tokens != 1 or not seq.output_token_ids:
            return 0  # a prompt chunk, or a recompute after preemption
        limit = min(self.num_speculative_tokens, budget, seq.max_model_len - seq.num_tokens)
        if seq.params.max_tokens is not None:
            limit = min(limit, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        if limit <= 0:
            return 0
        end = seq.num_computed_tokens + 1 + limit  # positions the step writes
        extra = self.blocks_for(end) - len(seq.block_ids)
        if extra > 0:
            blocks = self.allocator.allocate(extra)
            if blocks is None:  # speculation never preempts: draft into what it holds
                return max(0, min(limit, len(seq.block_ids) * self.block_size - (end - limit)))
            seq.block_ids.extend(blocks)
        return limit

    def _grow(
        self, seq: Sequence, num_new: int, batch: ScheduledBatch, scheduled: set[str]
    ) -> bool:
        """Give `seq` blocks for `num_new` more tokens, preempting later sequences if needed."""
        extra = self.blocks_for(seq.num_computed_tokens + num_new) - len(seq.block_ids)
        while extra > 0:
            blocks = self.allocator.allocate(extra)
            if blocks is not None:
                seq.block_ids.extend(blocks)
                return True
            victim = self.running[-1]
            if victim.request_id in scheduled:
                raise AssertionError("preempting a sequence already in this batch")
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_blocks(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _release_blocks(self, seq: Sequence) -> None:
        """Drop a non-running sequence's blocks; full ones stay cached and are matched again later.

        Waiting sequences must hold no blocks between steps: pinned cached blocks could be the
        ones a running sequence, or a preempted one re-queued ahead of this one, needs, and
        then nothing can ever be scheduled again.
        """
        self.allocator.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = seq.num_cached_tokens = seq.num_registered_blocks = 0

    def _attach_cached_prefix(self, seq: Sequence) -> tuple[int, int] | None:
        """Give a waiting sequence its cached leading blocks; (blocks looked up, blocks found),
        None when prefix caching is off. A sequence that wants prompt logprobs matches nothing:
        they come from the logits of every prompt position, which cached blocks never had."""
        if not self.allocator.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return None
        self._extend_hashes(seq, seq.num_tokens)
        # Leave at least one token to compute: its logits give the next token.
        usable = (seq.num_tokens - 1) // self.block_size
        blocks = self.allocator.match_prefix(seq.block_hashes[:usable])
        seq.block_ids = blocks
        seq.num_computed_tokens = seq.num_cached_tokens = len(blocks) * self.block_size
        seq.num_registered_blocks = len(blocks)
        return usable, len(blocks)

    def _extend_hashes(self, seq: Sequence, num_tokens: int) -> None:
        full = num_tokens // self.block_size
        if len(seq.block_hashes) >= full:
            return
        if not seq.block_hashes:
            seq.block_hashes = compute_block_hashes(
                seq.all_token_ids[: full * self.block_size], self.block_size
            )
            return
        tokens = seq.all_token_ids
        for b in range(len(seq.block_hashes), full):
            chunk = tokens[b * self.block_size : (b + 1) * self.block_size]
            seq.block_hashes.append(hash_block_tokens(seq.block_hashes[-1], chunk))

    # -- after the model ran --------------------------------------------------------------
    def update(
        self, batch: ScheduledBatch, sampled: Iterable[SampledToken | None]
    ) -> list[Sequence]:
        """Advance computed counts, append sampled tokens; return the sequences that finished."""
        self.commit(batch)
        return self.resolve(batch, sampled)

    def commit(self, batch: ScheduledBatch) -> None:
        """The step has been launched: its tokens count as computed and each sampling row owns
        the next output position (a placeholder until `resolve`)."""
        batch.output_index = []
        for item in batch.items:
            seq = item.seq
            index = None
            if not seq.is_finished:  # aborted since it was scheduled: nothing to advance
                seq.num_computed_tokens = item.start + item.num_new_tokens
                if item.samples:
                    index = len(seq.output_token_ids)
                    seq.output_token_ids.append(PLACEHOLDER)
            batch.output_index.append(index)

    def resolve(
        self,
        batch: ScheduledBatch,
        sampled: Iterable[SampledToken | list[SampledToken] | None],
    ) -> list[Sequence]:
        """Write a committed step's sampled tokens, register newly full blocks, apply the stop
        rules; returns the sequences that finished. Rows whose sequence ended meanwhile (an
        abort, or a stop found at the previous step) are skipped. A row's entry is its token,
        or the list of tokens a verify step emitted (accepted drafts, then the target's own)."""
        finished: list[Sequence] = []
        for row, (item, index, tokens) in enumerate(
            zip(batch.items, batch.output_index, sampled, strict=True)
        ):
            seq = item.seq
            if seq.is_finished:
                continue
            if index is None:
                self._register_full_blocks(seq)
                continue
            assert tokens, "a sampling row produced no token"
            if isinstance(tokens, SampledToken):
                tokens = [tokens]
            reason = None
            for m, token in enumerate(tokens):
                if token.logprob is not None:
                    seq.output_logprobs.append(token.logprob)
                if token.top_logprobs is not None:
                    seq.output_top_logprobs.append(token.top_logprobs)
                if m:
                    reason = seq.append_token(token.token_id)
                else:
                    reason = seq.resolve_token(index, token.token_id)
                if reason is not None:
                    break
            drafted = len(batch.drafts_of(row))
            if drafted:
                seq.spec.record(drafted, len(tokens) - 1)
                self.spec_totals.record(drafted, len(tokens) - 1)
                # Verified: the last token and the accepted drafts (the newest token's KV is
                # computed by the next step).
                seq.num_computed_tokens = item.start + len(tokens)
                if reason is None:
                    self._drop_unverified_blocks(seq)
            self._register_full_blocks(seq)
            if self.prefill_only:
                self._remove(seq)
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = reason  # None: decoding continues on a decode node
                finished.append(seq)
            elif reason is not None:
                self._remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _drop_unverified_blocks(self, seq: Sequence) -> None:
        """Free the blocks past the sequence's tokens: they hold only rejected drafts' KV."""
        keep = self.blocks_for(seq.num_tokens)
        extra = seq.block_ids[keep:]
        if not extra:
            return
        del seq.block_ids[keep:]
        seq.num_block_trims += 1
        if self.hold_frees:
            self._held.extend(extra)
        else:
            self.allocator.free(extra)

    def take_held(self) -> list[int]:
        """Blocks held back while a step was in flight; the caller frees them once every step
        that may still write them has completed."""
        held, self._held = self._held, []
        return held

    def _remove(self, seq: Sequence) -> None:
        # Running, or waiting when it was preempted while its last step was in flight.
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)

    def _register_full_blocks(self, seq: Sequence) -> None:
        if not self.allocator.enable_prefix_caching or seq.status is SequenceStatus.WAITING:
            return
        # Only blocks whose every token is on the host (a placeholder can only be the last).
        known = seq.num_tokens - (seq.output_token_ids[-1:] == [PLACEHOLDER])
        full = min(seq.num_computed_tokens, known) // self.block_size
        if full <= seq.num_registered_blocks:
            return
        self._extend_hashes(seq, full * self.block_size)
        for b in range(seq.num_registered_blocks, full):
            self.allocator.register_full_block(seq.block_ids[b], seq.block_hashes[b])
        seq.num_registered_blocks = full

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.drop_unresolved()
        if seq.block_ids:
            if self.hold_frees:
                self._held.extend(seq.block_ids)
            else:
                self.allocator.free(seq.block_ids)
            seq.block_ids = []
