"""The draft-model proposer (`--speculative-method draft`): a smaller model with the target's
tokenizer drafts its greedy continuation.

KV: the draft has its own pool (`ProposerPool`, same blocks and block size as the target's)
addressed with the target sequence's block ids. Per request it remembers how many leading
positions its pool holds verified tokens for (`seen`). Nobody reports acceptances: at the next
`propose` the drafts it wrote last time are compared with the tokens the sequence now has, and
the matching prefix counts as seen (a token equal to the draft at its position was accepted: a
rejected one-hot draft is never resampled). A preempted sequence starts over from position 0.

`propose` runs, batched over the speculating sequences: one forward over each sequence's
tokens the draft has not seen (for a new request its whole prompt: on a decode node the draft
computes the prompt's KV itself, since none is shipped for it), draft 1 is the argmax of each
last row; then `limit - 1` single-token steps for drafts 2..limit. Drafts are argmaxes, so
`Drafts.probs` is None.

Speed (`capture_graphs`, called by the Worker with the target's graphs): the catch-up runs as
decode rows (each attends up to its own position, as the runner's verify rows) in the draft's
`DecodeGraphs` when they fit, eagerly otherwise (a prompt); the single-token steps replay the
same graphs, the first staged from the host, later ones moved on the device
(`DecodeGraphs.advance`). Drafted ids stay on the device until the end of `propose`, which
reads them all with its one host sync.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.engine.config import SpeculativeConfig
from common.engine.cuda_graphs import DecodeGraphs, Replay
from common.engine.kv_cache import KVCache
from common.engine.model_runner import block_table_key
from common.engine.scheduler import ScheduledBatch
from common.engine.sequence import PLACEHOLDER, Sequence
from common.engine.spec_decode.paged import PagedRows, ProposerPool, draft_blocks, drafting_rows
from common.engine.spec_decode.proposer import Drafts
from common.model.attention import AttentionBackend
from common.model.loader import build_model
from common.model.registry import CausalLM
from common.model.source import ModelSource, read_spec, resolve_model
from common.model.spec import ModelSpec

log = logging.getLogger(__name__)


def check_draft_vocabulary(
    draft: ModelSpec, draft_dir: Path, target: ModelSpec, target_dir: Path
) -> None:
    """ValueError naming both sides unless the draft's token ids mean the target's: its
    vocabulary no larger, the same EOS ids, the same tokenizer.json when both ship one."""
    if draft.vocab_size > target.vocab_size:
        raise ValueError(
            f"draft model {draft_dir} has vocab_size {draft.vocab_size}, larger than the "
            f"target {target_dir}'s {target.vocab_size}"
        )
    if set(draft.eos_token_ids) != set(target.eos_token_ids):
        raise ValueError(
            f"draft model {draft_dir} has EOS ids {sorted(draft.eos_token_ids)}, the target "
            f"{target_dir} {sorted(target.eos_token_ids)}"
        )
    draft_tok, target_tok = draft_dir / "tokenizer.json", target_dir / "tokenizer.json"
    if draft_tok.exists() and target_tok.exists():
        if draft_tok.read_bytes() != target_tok.read_bytes():
            raise ValueError(f"draft tokenizer {draft_tok} differs from the target's {target_tok}")


@dataclass
class _DraftState:
    num_preemptions: int
    seen: int = 0  # leading positions whose draft KV holds the sequence's verified tokens
    fed: list[int] = field(default_factory=list)  # drafts written at positions seen, seen+1, ...


class DraftModelProposer:
    method = "draft"

    def __init__(self, model: CausalLM, pool: ProposerPool) -> None:
        self.model = model
        self.pool = pool
        self.block_size = pool.kv_cache.block_size
        # A draft vocabulary may be smaller than the target's (rows the tokenizer never
        # produces, as Qwen2.5's sizes differ): a target id past it is fed to the draft as 0,
        # which only costs acceptance.
        self.vocab_size = model.spec.vocab_size
        self._states: dict[str, _DraftState] = {}
        self.graphs: DecodeGraphs | None = None  # set by `capture_graphs`
        self._arange: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        config: SpeculativeConfig,
        target: ModelSource,
        target_spec: ModelSpec,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        backend: AttentionBackend,
    ) -> DraftModelProposer:
        """Load `config.speculative_model` (any checkpoint `resolve_model` reads) and give it a
        pool of `num_blocks` blocks of `block_size` (the target's) in `dtype`."""
        if config.speculative_model is None:
            raise ValueError("the draft proposer needs --speculative-model")
        source = resolve_model(config.speculative_model, dtype=str(dtype).removeprefix("torch."))
        spec = read_spec(source)
        check_draft_vocabulary(spec, source.directory, target_spec, target.directory)
        model = build_model(
            spec,
            source,
            max_positions=max_model_len + config.num_speculative_tokens,
            dtype=dtype,
            device=device,
        )
        kv = KVCache.allocate(spec, num_blocks, block_size, dtype, device)
        log.info("draft model %s: %d layers, KV pool of %d blocks", source.name, spec.num_layers,
                 num_blocks)  # fmt: skip
        return cls(model, ProposerPool(kv, backend, device, spec.attention_scale))

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def capture_graphs(self, max_rows: int, max_model_len: int) -> int:
        """Decode graphs of the draft over its pool for up to `max_rows` rows (the target's
        decode graph rows); on CPU their buffers only, replays run eagerly. Returns bytes."""
        model, pool = self.model, self.pool
        self.graphs = DecodeGraphs(model, pool.backend, pool.kv_cache, max_rows, max_model_len,
                                   model.spec.attention_scale)  # fmt: skip
        self._arange = torch.arange(self.graphs.max_batch, device=pool.device)
        return self.graphs.capture()

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch, limits: list[int]) -> Drafts:
        drafts: list[list[int]] = [[] for _ in batch.items]
        active = drafting_rows(batch, limits)
        if not active:
            return Drafts(drafts)
        seqs = [batch.items[i].seq for i in active]
        ks = [limits[i] for i in active]
        replays: list[Replay] = []
        try:
            steps = [self._first_drafts(seqs, ks, replays)]
            for step in range(1, ks[0]):
                live = sum(k > step for k in ks)
                steps.append(self._next_drafts(seqs, step, steps[-1][:live], replays))
            # The one host sync of a propose: every step's drafts at once.
            flat = torch.cat(steps).tolist()
        except BaseException:
            self._release(replays, failed=True)
            raise
        self._release(replays, failed=False)
        at = 0
        for step in steps:
            for r in range(len(step)):
                drafts[active[r]].append(flat[at + r])
            at += len(step)
        for i, seq in zip(active, seqs, strict=True):
            state = self._states[seq.request_id]
            state.seen, state.fed = seq.num_tokens, drafts[i][:-1]
        return Drafts(drafts)

    def _first_drafts(
        self, seqs: list[Sequence], ks: list[int], replays: list[Replay]
    ) -> torch.Tensor:
        """Catch up on each sequence's tokens the draft has not seen; its greedy next token
        (device). Decode rows in a graph when they fit, else one eager forward (a prompt)."""
        states = [self._catch_up(seq) for seq in seqs]
        pending = sum(seq.num_tokens - state.seen for seq, state in zip(seqs, states, strict=True))
        graphs = self.graphs
        rows = PagedRows(self.block_size)
        for seq, state, k in zip(seqs, states, ks, strict=True):
            tokens = [t if t < self.vocab_size else 0 for t in seq.all_token_ids[state.seen :]]
            blocks = draft_blocks(seq, k, self.block_size)
            if graphs is not None and graphs.fits(pending):
                rows.add_decode_rows(tokens, state.seen, blocks, block_table_key(seq))
            else:
                rows.add(tokens, state.seen, blocks)
        last = self.pool.last_rows(rows)
        if rows.row_keys:
            replay = graphs.launch(rows.input_ids, rows.positions, rows.slots, rows.seq_lens,
                                   rows.block_tables, rows.row_keys)  # fmt: skip
            replays.append(replay)
            return replay.output.index_select(0, last).argmax(dim=-1)
        ids, positions, ctx = self.pool.inputs(rows)
        hidden = self.model(ids, positions, ctx).index_select(0, last)
        return self.model.compute_logits(hidden).argmax(dim=-1)

    def _next_drafts(
        self, seqs: list[Sequence], step: int, previous: torch.Tensor, replays: list[Replay]
    ) -> torch.Tensor:
        """Draft `step + 1` of the first len(`previous`) sequences, fed their draft `step`
        (device ids): a graph replay, the first one staged, later ones moved on the device."""
        live = len(previous)
        graphs = self.graphs
        if graphs is not None and graphs.fits(live):
            if step > 1:
                return graphs.advance(previous).argmax(dim=-1)
            positions = [seq.num_tokens for seq in seqs[:live]]
            blocks = [seq.block_ids for seq in seqs[:live]]
            bs = self.block_size
            replay = graphs.launch(
                [0] * live,
                positions,
                [b[p // bs] * bs + p % bs for p, b in zip(positions, blocks, strict=True)],
                [p + 1 for p in positions],
                blocks,
                [block_table_key(seq) for seq in seqs[:live]],
                fill_ids=(self._arange[:live], previous),
            )
            replays.append(replay)
            return replay.output.argmax(dim=-1)
        rows = PagedRows(self.block_size)
        for seq in seqs[:live]:
            rows.add([0], seq.num_tokens + step - 1, seq.block_ids)
        _, positions, ctx = self.pool.inputs(rows)
        hidden = self.model(previous, positions, ctx)
        return self.model.compute_logits(hidden).argmax(dim=-1)

    def _release(self, replays: list[Replay], failed: bool) -> None:
        """Give the graphs' staging slots back: after the propose's sync they have been read;
        after a failure, once the device has finished."""
        if failed and replays and self.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.device)
        for replay in replays:
            replay.release()

    def _catch_up(self, seq: Sequence) -> _DraftState:
        """The request's state with `seen` advanced over the drafts that were accepted, and at
        most its last token (whose row gives draft 1)."""
        state = self._states.get(seq.request_id)
        if state is None or state.num_preemptions != seq.num_preemptions:
            state = self._states[seq.request_id] = _DraftState(seq.num_preemptions)
        tokens = seq.all_token_ids
        assert PLACEHOLDER not in tokens[state.seen :], "speculation needs every token on the host"
        kept = 0
        for draft, token in zip(state.fed, tokens[state.seen :], strict=False):
            if draft != token:
                break
            kept += 1
        state.seen = min(state.seen + kept, seq.num_tokens - 1)
        state.fed = []
        return state
