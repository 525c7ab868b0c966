"""The EAGLE-3 proposer (`--speculative-method eagle3`): a one-layer head (`common.model.eagle3`)
fed the target's auxiliary hidden states drafts tokens autoregressively.

Interface (the runner wires it):
- `build` loads the head and switches the target's `LlamaModel.aux_hidden_layers` on, so every
  target forward leaves `model.aux_hidden` ([T, 3H]: one row per token row).
- `observe(request_ids, starts, counts, aux_hidden)` after every target forward, with every
  item of the step (prompt chunks, plain decodes, verify rows): item i's `counts[i]`
  consecutive rows of `aux_hidden`, in item order, are its hidden states at positions
  `starts[i]`, `starts[i] + 1`, ... Rows past sum(counts) (graph padding) are ignored. The rows
  are copied: the caller may reuse the tensor.
- `propose(batch, limits)` as every proposer; `release(request_id)` at the end of a request.

Per request the proposer keeps the observed rows it has not consumed, by position (a later
observation of a position replaces an earlier one: a rejected draft's row is recomputed by the
next step), and `seen`: the head's KV (its own pool, the target's block ids, as
`DraftModelProposer`) holds rows for the positions before it. `propose` runs the head over
positions seen..n-2 (row p: hidden state at p, token at p + 1; n = the sequence's tokens);
the last row gives draft 1, then `limit - 1` single-row steps feed the previous draft and the
head's own `prenorm` output. A position never observed (prompt KV from the prefix cache or a
prefill node, or consumed before a preemption) enters the head with a zero hidden state: the
drafts stay valid (verification keeps the output exact), acceptance is lower. Counted in
`num_unobserved_rows`; feeding those states through `observe` (e.g. shipped with the KV)
avoids it.

Speed (`capture_graphs`, called by the Worker with the target's graphs): the first forward runs
as decode rows in `HeadGraphs` when they fit (eagerly for a prompt), the single-token steps
replay the same graphs (the first staged, later ones fed their own outputs on the device), and
the drafted ids reach the host once, at the end of `propose`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from common.engine.config import SpeculativeConfig
from common.engine.kv_cache import KVCache
from common.engine.scheduler import ScheduledBatch
from common.engine.sequence import PLACEHOLDER, Sequence
from common.engine.spec_decode.head_graphs import HeadGraphs
from common.engine.spec_decode.paged import PagedRows, ProposerPool, draft_blocks, drafting_rows
from common.engine.spec_decode.proposer import Drafts
from common.model.attention import AttentionBackend
from common.model.eagle3 import Eagle3Head, load_eagle3_head
from common.model.llama import LlamaForCausalLM
from common.model.source import resolve_model

log = logging.getLogger(__name__)


@dataclass
class _HeadState:
    num_preemptions: int
    seen: int = 0  # the head's KV holds rows for positions < seen
    start: int = 0  # position of hidden[0]
    hidden: torch.Tensor | None = None  # observed target rows not consumed yet

    def put(self, start: int, rows: torch.Tensor) -> None:
        """Rows for positions start.. replace whatever was observed there and after."""
        if self.hidden is None or start < self.start:
            self.start, self.hidden = start, rows.clone()
            return
        end = self.start + len(self.hidden)
        if start > end:  # a gap: positions nobody observed
            gap = rows.new_zeros(start - end, rows.shape[1])
            self.hidden = torch.cat([self.hidden, gap, rows])
        else:
            self.hidden = torch.cat([self.hidden[: start - self.start], rows])

    def take(self, begin: int, end: int, like: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(rows for positions begin..end-1, zeros where unobserved; how many were); keeps
        only rows from end - 1 on (the last one may be read again)."""
        out = like.new_zeros(end - begin, like.shape[1])
        observed = 0
        if self.hidden is not None:
            lo, hi = max(begin, self.start), min(end, self.start + len(self.hidden))
            if lo < hi:
                out[lo - begin : hi - begin] = self.hidden[lo - self.start : hi - self.start]
                observed = hi - lo
            keep = max(0, end - 1 - self.start)
            self.hidden = self.hidden[keep:] if keep < len(self.hidden) else None
            self.start += keep
        return out, end - begin - observed


class Eagle3Proposer:
    method = "eagle3"

    def __init__(self, head: Eagle3Head, pool: ProposerPool) -> None:
        self.head = head
        self.pool = pool
        self.block_size = pool.kv_cache.block_size
        self.num_unobserved_rows = 0  # head rows run with a zero hidden state (see above)
        self._states: dict[str, _HeadState] = {}
        self.graphs: HeadGraphs | None = None  # set by `capture_graphs`
        width = 3 * head.spec.target_hidden_size
        self._like = torch.empty(0, width, dtype=head.fc.weight.dtype, device=pool.device)

    @classmethod
    def build(
        cls,
        config: SpeculativeConfig,
        target: LlamaForCausalLM,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        backend: AttentionBackend,
    ) -> Eagle3Proposer:
        """Load the head in `config.speculative_model` for `target` (one rank), give it a pool
        of the target's `num_blocks` x `block_size`, and turn the target's aux outputs on."""
        if config.speculative_model is None:
            raise ValueError("the eagle3 proposer needs --speculative-model")
        if target.tp.size > 1:
            raise ValueError(f"EAGLE-3 runs on one rank; the target has tp={target.tp.size}")
        source = resolve_model(config.speculative_model)
        head = load_eagle3_head(
            source.directory,
            target.spec,
            target.model.embed_tokens,
            max_positions=max_model_len + config.num_speculative_tokens,
            dtype=dtype,
            device=device,
        )
        target.model.aux_hidden_layers = head.spec.aux_layers(target.spec.num_layers)
        layer = head.spec.layer
        kv = KVCache.allocate(layer, num_blocks, block_size, dtype, device)
        log.info("EAGLE-3 head %s reads target layers %s", source.name,
                 target.model.aux_hidden_layers)  # fmt: skip
        return cls(head, ProposerPool(kv, backend, device, layer.attention_scale))

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def observe(
        self,
        request_ids: list[str],
        starts: list[int],
        counts: list[int],
        aux_hidden: torch.Tensor,
    ) -> None:
        if not len(request_ids) == len(starts) == len(counts):
            raise ValueError(
                f"{len(request_ids)} request ids, {len(starts)} starts, {len(counts)} counts"
            )
        if sum(counts) > aux_hidden.shape[0] or aux_hidden.shape[1] != self._like.shape[1]:
            raise ValueError(
                f"aux_hidden {tuple(aux_hidden.shape)} for {sum(counts)} rows of "
                f"{self._like.shape[1]}"
            )
        row = 0
        for rid, start, n in zip(request_ids, starts, counts, strict=True):
            if n:
                state = self._states.setdefault(rid, _HeadState(num_preemptions=-1))
                state.put(start, aux_hidden[row : row + n])
            row += n

    def capture_graphs(self, max_rows: int, max_model_len: int) -> int:
        """Graphs of the head's step for up to `max_rows` decode rows (`HeadGraphs`); on CPU
        their buffers only. Returns bytes."""
        self.graphs = HeadGraphs(self.head, self.pool, max_rows, max_model_len)
        return self.graphs.capture()

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch, limits: list[int]) -> Drafts:
        drafts: list[list[int]] = [[] for _ in batch.items]
        active = drafting_rows(batch, limits)
        if not active:
            return Drafts(drafts)
        seqs = [batch.items[i].seq for i in active]
        ks = [limits[i] for i in active]
        ids, hidden = self._first_drafts(seqs, ks)
        steps = [ids]
        for step in range(1, ks[0]):
            live = sum(k > step for k in ks)
            ids, hidden = self._next_drafts(seqs, step, ids[:live], hidden[:live])
            steps.append(ids)
        flat = torch.cat(steps).tolist()  # the one host sync of a propose
        at = 0
        for step_ids in steps:
            for r in range(len(step_ids)):
                drafts[active[r]].append(flat[at + r])
            at += len(step_ids)
        return Drafts(drafts)

    def _first_drafts(
        self, seqs: list[Sequence], ks: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the head over each sequence's positions seen..n-2; (draft 1 of each, the
        prenorm state of its last row), on the device. Decode rows in a graph when they fit,
        else one eager forward (a prompt)."""
        states = [self._state(seq) for seq in seqs]
        begins = [min(st.seen, seq.num_tokens - 2) for seq, st in zip(seqs, states, strict=True)]
        pending = sum(seq.num_tokens - 1 - b for seq, b in zip(seqs, begins, strict=True))
        graph = self.graphs is not None and self.graphs.fits(pending)
        rows, aux = PagedRows(self.block_size), []
        for seq, state, begin, k in zip(seqs, states, begins, ks, strict=True):
            tokens, n = seq.all_token_ids, seq.num_tokens
            assert PLACEHOLDER not in tokens[state.seen :], "speculation needs host tokens"
            hidden, unobserved = state.take(begin, n - 1, self._like)
            self.num_unobserved_rows += unobserved
            aux.append(hidden)
            blocks = draft_blocks(seq, k, self.block_size)
            if graph:
                rows.add_decode_rows(tokens[begin + 1 : n], begin, blocks, ())
            else:
                rows.add(tokens[begin + 1 : n], begin, blocks)
            state.seen = n - 1
        combined = self.head.combine(torch.cat(aux))
        last = self.pool.last_rows(rows)
        if graph:
            ids, prenorm = self.graphs.launch(rows, combined)
            return ids.index_select(0, last), prenorm.index_select(0, last)
        ids, positions, ctx = self.pool.inputs(rows)
        return self._eager(ids, positions, combined, ctx, last)

    def _next_drafts(
        self, seqs: list[Sequence], step: int, previous: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft `step + 1` of the first len(`previous`) sequences, fed draft `step` and the
        head's prenorm state of it: a graph replay (the first staged, later ones advanced on
        the device) or an eager forward."""
        live = len(previous)
        rows = PagedRows(self.block_size)
        for seq in seqs[:live]:
            rows.add([0], seq.num_tokens - 2 + step, seq.block_ids)
        if self.graphs is not None and self.graphs.fits(live):
            if step > 1:
                ids, prenorm = self.graphs.advance(live)
            else:
                ids, prenorm = self.graphs.launch(rows, hidden, previous)
            return ids.clone(), prenorm  # the next step overwrites the graph's outputs
        _, positions, ctx = self.pool.inputs(rows)
        return self._eager(previous, positions, hidden, ctx, None)

    def _eager(self, ids, positions, hidden, ctx, last: torch.Tensor | None):
        """(target ids of the argmax drafts, prenorm) of the rows `last` (None: all)."""
        normed, prenorm = self.head(ids, positions, hidden, ctx)
        if last is not None:
            normed, prenorm = normed.index_select(0, last), prenorm.index_select(0, last)
        draft_ids = self.head.compute_logits(normed).argmax(dim=-1)
        return self.head.to_target(draft_ids), prenorm

    def _state(self, seq: Sequence) -> _HeadState:
        """The request's state; a preempted sequence's head KV is gone (new blocks)."""
        state = self._states.setdefault(seq.request_id, _HeadState(seq.num_preemptions))
        if state.num_preemptions != seq.num_preemptions:
            state.num_preemptions, state.seen = seq.num_preemptions, 0
        return state
