"""The node models the simulator steps: a prefill node and a decode node (which is also the
colocated node). Pure Python, times in seconds, no clock of their own: the simulator calls
`plan_step` when a node is free and `finish_step` when that step's time has passed.

They mirror `common/engine/scheduler.py` and the node loops: a token budget per step
(`max_num_batched_tokens`), at most `max_num_seqs` sequences running, blocks allocated just
before the step that fills them, preemption of the latest running sequence when the pool runs
dry (it is recomputed later), FIFO admission, and on the decode node FIFO reservations that
leave `headroom_blocks` free while anything runs (`DecodeNode._growth_headroom`). Running
decodes are not walked one by one: a step advances every context by one, a heap holds the step
at which each sequence ends, and the steps at which a sequence needs a new block repeat every
`block_size` steps (`_grow`), so a decode step costs O(1) plus its events.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from pdserve.planner.cost_model import CostModel, attention_pairs


@dataclass(eq=False)
class SimJob:
    """One request as the nodes see it. `target`: tokens a prefill (or a recompute after
    preemption) must compute; `remaining`: tokens still to generate."""

    index: int
    arrival: float
    prompt_len: int
    output_len: int
    group: int | None = None
    prefix_len: int = 0
    target: int = 0
    computed: int = 0
    remaining: int = 0
    first_token: float | None = None
    finish: float | None = None
    prefill_node: int = -1
    decode_node: int = -1
    join_k: int = 0  # decode: step index of its first decode step
    join_ctx: int = 0  # decode: tokens of KV at join_k
    epoch: int = 0  # bumped on preemption: its heap entries are stale


MAX_RUN = 4096  # decode steps one plan may cover


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass
class StepPlan:
    duration: float
    chunks: list[tuple[SimJob, int]] = field(default_factory=list)
    decodes: int = 0
    steps: int = 1  # decode-only plans may cover several identical steps (cut short by events)
    context_sum: int = 0


class PrefillSim:
    """A prefill node: reserved prompts in FIFO order, chunked into token-budgeted steps; a
    finished prompt keeps its blocks until its KV transfer is done (`release`)."""

    def __init__(
        self, cost: CostModel, max_tokens: int, max_seqs: int, blocks: int, block_size: int
    ) -> None:
        self.cost, self.max_tokens, self.max_seqs = cost, max_tokens, max_seqs
        self.total, self.used, self.block_size = blocks, 0, block_size
        self.queue: deque[SimJob] = deque()
        self.load_tokens = 0  # prompt tokens sent here, not yet prefilled (the router's view)
        self.busy = False
        self.cached_groups: set[int] = set()

    def add(self, job: SimJob) -> None:
        job.target, job.computed = job.prompt_len, 0
        self.queue.append(job)

    def release(self, job: SimJob) -> None:
        self.used -= blocks_for(job.prompt_len, self.block_size)

    def plan_step(self) -> StepPlan | None:
        budget, chunks = self.max_tokens, []
        for job in self.queue:
            if budget <= 0 or len(chunks) >= self.max_seqs:
                break
            if job.computed == 0:
                job.computed = _cached(job, self.cached_groups, self.block_size)
                self.used += blocks_for(job.computed, self.block_size)
            n = min(job.target - job.computed, budget)
            extra = blocks_for(job.computed + n, self.block_size) - blocks_for(
                job.computed, self.block_size
            )
            if self.used + extra > self.total:
                break  # waits for transfers to free blocks
            self.used += extra
            chunks.append((job, n))
            budget -= n
        if not chunks:
            return None
        tokens = sum(n for _, n in chunks)
        pairs = sum(attention_pairs(n, job.computed) for job, n in chunks)
        return StepPlan(self.cost.step_time(tokens, pairs, 0, 0), chunks)

    def finish_step(self, plan: StepPlan) -> list[SimJob]:
        """Advance the chunks; the prompts that ended (their first token is sampled now)."""
        done = []
        for job, n in plan.chunks:
            job.computed += n
            if job.computed == job.target:
                done.append(job)
                if job.group is not None:
                    self.cached_groups.add(job.group)
        for job in done:
            self.queue.remove(job)
        return done


def _cached(job: SimJob, groups: set[int], block_size: int) -> int:
    """Tokens of the shared prefix found in a node's prefix cache (whole blocks, and at least
    one prompt token left to compute)."""
    if job.group is None or job.group not in groups or job.target != job.prompt_len:
        return 0
    usable = min(job.prefix_len, job.prompt_len - 1) // block_size
    return usable * block_size


class DecodeSim:
    """A decode node (KV arrives through reservations) or, `colocated`, a node that also
    prefills its own prompts in the same steps."""

    def __init__(
        self,
        cost: CostModel,
        max_tokens: int,
        max_seqs: int,
        blocks: int,
        block_size: int,
        headroom_blocks: int,
    ) -> None:
        self.cost, self.max_tokens, self.max_seqs = cost, max_tokens, max_seqs
        self.total, self.used, self.block_size = blocks, 0, block_size
        self.headroom = headroom_blocks
        self.reservations: deque[SimJob] = deque()  # PD: waiting for blocks
        self.reserved = 0  # PD: reserved, KV not landed yet
        self.ready: deque[SimJob] = deque()  # PD: KV landed, waiting for a running slot
        self.waiting: deque[SimJob] = deque()  # prompts to prefill here; preempted ones first
        self.running: dict[int, SimJob] = {}  # admission order (the latest is preempted first)
        self.prefilling: dict[int, SimJob] = {}  # running, tokens left to compute (in order)
        self.k = 0  # decode step index
        self.context_sum = 0  # KV tokens of the decoding sequences at step k
        self.ends: list[tuple[int, int, int, SimJob]] = []  # (last step, index, epoch, job)
        self.grow = [0] * block_size  # decoding sequences needing a block at steps = r mod bs
        self.busy = False
        self.cached_groups: set[int] = set()

    # -- the router's view ----------------------------------------------------------------
    def free_blocks(self) -> int:
        pending = sum(blocks_for(j.prompt_len, self.block_size) for j in self.reservations)
        return self.total - self.used - pending

    def num_requests(self) -> int:
        return len(self.running) + len(self.ready) + len(self.waiting) + self.reserved

    # -- PD: reservations and landed KV ---------------------------------------------------
    def reserve(self) -> list[SimJob]:
        """Reserve blocks for waiting requests in FIFO order, leaving the growth headroom
        (none on an empty node; nothing while a preempted sequence waits)."""
        out = []
        while self.reservations and not self.waiting:
            empty = not (self.running or self.ready or self.reserved)
            need = blocks_for(self.reservations[0].prompt_len, self.block_size)
            if self.total - self.used - need < (0 if empty else self.headroom):
                break
            job = self.reservations.popleft()
            self.used += need
            self.reserved += 1
            out.append(job)
        return out

    def cancel_reservation(self, job: SimJob) -> None:
        """The prefill node's first token ended the request: the reservation is released."""
        self.reserved -= 1
        self.used -= blocks_for(job.prompt_len, self.block_size)

    def land(self, job: SimJob) -> None:
        self.reserved -= 1
        job.join_ctx, job.remaining = job.prompt_len, job.output_len - 1
        self.ready.append(job)

    def add_prompt(self, job: SimJob) -> None:
        """Colocated: a new request to prefill here."""
        job.target, job.computed, job.remaining = job.prompt_len, 0, job.output_len
        self.waiting.append(job)

    # -- one step -------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.running or self.ready or self.waiting)

    def plan_step(self) -> StepPlan | None:
        while self.ready and len(self.running) < self.max_seqs:
            self._join(self.ready.popleft())
        preempted = self._grow_decodes()
        budget = self.max_tokens - self._num_decoding()
        chunks = []
        for job in list(self.prefilling.values()):
            n = min(job.target - job.computed, budget)
            if n <= 0 or not self._take(job.computed, job.computed + n):
                continue
            chunks.append((job, n))
            budget -= n
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            job = self.waiting[0]
            start = job.computed or _cached(job, self.cached_groups, self.block_size)
            n = min(job.target - start, budget)
            if not self._take(0, start + n):
                break
            job.computed = start
            self.waiting.popleft()
            self.running[job.index] = job
            self.prefilling[job.index] = job
            chunks.append((job, n))
            budget -= n
        decodes = self._num_decoding()
        if not chunks and not decodes:
            return None
        if not chunks and not preempted:
            return self._decode_run(decodes)
        tokens = sum(n for _, n in chunks)
        pairs = sum(attention_pairs(n, job.computed) for job, n in chunks)
        duration = self.cost.step_time(tokens, pairs, decodes, self.context_sum)
        return StepPlan(duration, chunks, decodes, 1, self.context_sum)

    def _decode_run(self, decodes: int) -> StepPlan:
        """Decode-only steps up to the next sequence's end, as far as the pool lets every
        sequence grow (this step's blocks are already taken); events cut it short (`cut`)."""
        while self.ends and self.ends[0][2] != self.ends[0][3].epoch:
            heapq.heappop(self.ends)  # stale: that sequence was preempted
        steps = self.ends[0][0] - self.k + 1 if self.ends else 1
        free = self.total - self.used
        steps = max(1, min(steps, MAX_RUN, self.block_size * (free // decodes) + 1))
        self.used += self._growth(self.k + 1, steps - 1)
        plan = StepPlan(0.0, [], decodes, steps, self.context_sum)
        plan.duration = self.cost.decode.steps_time(decodes, self.context_sum, steps)
        return plan

    def cut(self, plan: StepPlan, elapsed: float) -> None:
        """An event reached this node `elapsed` seconds into a multi-step plan: it ends with
        the step in progress (a node sees new work between steps)."""
        if plan.steps <= 1:
            return
        lo, hi = 1, plan.steps
        while lo < hi:  # the fewest steps whose time covers `elapsed`
            mid = (lo + hi) // 2
            if self.cost.decode.steps_time(plan.decodes, plan.context_sum, mid) >= elapsed:
                hi = mid
            else:
                lo = mid + 1
        self.used -= self._growth(self.k + lo, plan.steps - lo)
        plan.steps = lo
        plan.duration = self.cost.decode.steps_time(plan.decodes, plan.context_sum, lo)

    def _growth(self, first: int, steps: int) -> int:
        """New blocks the decoding sequences take over steps first .. first+steps-1."""
        if steps <= 0:
            return 0
        bs, full, rest = self.block_size, steps // self.block_size, steps % self.block_size
        return sum(n * (full + ((r - first) % bs < rest)) for r, n in enumerate(self.grow) if n)

    def finish_step(self, plan: StepPlan, now: float) -> list[SimJob]:
        """Advance the step that ran; return the requests whose first token it sampled (their
        `first_token` is set). Finished requests get `finish` and free their blocks."""
        firsts = []
        if plan.decodes:
            self.k += plan.steps
            self.context_sum += plan.decodes * plan.steps
            while self.ends and self.ends[0][0] < self.k:
                _, index, epoch, job = heapq.heappop(self.ends)
                if epoch == job.epoch and index in self.running:
                    self._end_decode(job, now)
        for job, n in plan.chunks:
            job.computed += n
            if job.computed < job.target:
                continue
            del self.prefilling[job.index]
            if job.first_token is None:
                job.first_token = now
                firsts.append(job)
                if job.group is not None:
                    self.cached_groups.add(job.group)
            job.remaining -= 1
            if job.remaining <= 0:
                self._finish(job, blocks_for(job.target, self.block_size), now)
            else:
                del self.running[job.index]  # re-enters at the end as a decode
                job.join_ctx = job.target
                self._join(job)
        return firsts

    # -- internals ------------------------------------------------------------------------
    def _num_decoding(self) -> int:
        return len(self.running) - len(self.prefilling)

    def _take(self, have_tokens: int, tokens: int) -> bool:
        extra = blocks_for(tokens, self.block_size) - blocks_for(have_tokens, self.block_size)
        if self.used + extra > self.total:
            return False
        self.used += extra
        return True

    def _join(self, job: SimJob) -> None:
        """Start decoding at the next step with `join_ctx` tokens of KV in its blocks."""
        job.join_k = self.k
        self.running[job.index] = job
        self.context_sum += job.join_ctx
        self.grow[(job.join_k - job.join_ctx) % self.block_size] += 1
        heapq.heappush(self.ends, (job.join_k + job.remaining - 1, job.index, job.epoch, job))

    def _ctx(self, job: SimJob) -> int:
        return job.join_ctx + self.k - job.join_k

    def _leave_decode(self, job: SimJob) -> int:
        """Take a decoding job out; its KV tokens."""
        ctx = self._ctx(job)
        del self.running[job.index]
        self.context_sum -= ctx
        self.grow[(job.join_k - job.join_ctx) % self.block_size] -= 1
        return ctx

    def _end_decode(self, job: SimJob, now: float) -> None:
        ctx = self._leave_decode(job)
        self._finish(job, blocks_for(ctx, self.block_size), now)

    def _finish(self, job: SimJob, blocks: int, now: float) -> None:
        job.finish = now
        self.running.pop(job.index, None)
        self.used -= blocks

    def _grow_decodes(self) -> bool:
        """Blocks for this step's decodes; preempt the latest running sequences while the pool
        is short. True if anything was preempted."""
        preempted = False
        while self.used + self.grow[self.k % self.block_size] > self.total and self.running:
            preempted = True
            self._preempt(next(reversed(self.running.values())))
        self.used += self.grow[self.k % self.block_size]
        return preempted

    def _preempt(self, job: SimJob) -> None:
        job.epoch += 1
        if job.index in self.prefilling:
            del self.prefilling[job.index]
            del self.running[job.index]
            self.used -= blocks_for(job.computed, self.block_size)
        else:
            done = self.k - job.join_k  # tokens generated since it joined
            ctx = self._leave_decode(job)
            self.used -= blocks_for(ctx, self.block_size)
            job.remaining -= done
            job.target = ctx + 1  # recompute every known token; its last samples the next
        job.computed = 0
        self.waiting.appendleft(job)
