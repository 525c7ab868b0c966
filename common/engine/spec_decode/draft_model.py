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
last row; then `limit - 1` single-token steps (eager) for drafts 2..limit. Drafts are argmaxes,
so `Drafts.probs` is None.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.engine.config import SpeculativeConfig
from common.engine.kv_cache import KVCache
from common.engine.scheduler import ScheduledBatch
from common.engine.sequence import PLACEHOLDER, Sequence
from common.engine.spec_decode.paged import PagedRows, ProposerPool, draft_blocks
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
        return cls(model, ProposerPool(kv, backend, device, spec.head_dim))

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch, limits: list[int]) -> Drafts:
        if len(limits) != len(batch.items):
            raise ValueError(f"{len(limits)} limits for {len(batch.items)} batch items")
        drafts: list[list[int]] = [[] for _ in batch.items]
        active = [i for i, k in enumerate(limits) if k > 0]
        if not active:
            return Drafts(drafts)
        seqs = {i: batch.items[i].seq for i in active}
        rows = PagedRows(self.block_size)
        for i in active:
            seq = seqs[i]
            state = self._catch_up(seq)
            tokens = [t if t < self.vocab_size else 0 for t in seq.all_token_ids[state.seen :]]
            rows.add(tokens, state.seen, draft_blocks(seq, limits[i], self.block_size))
        for i, token in zip(active, self._argmax(rows), strict=True):
            drafts[i].append(token)
        for step in range(1, max(limits[i] for i in active)):
            live = [i for i in active if limits[i] > step]
            rows = PagedRows(self.block_size)
            for i in live:
                rows.add([drafts[i][-1]], seqs[i].num_tokens + step - 1, seqs[i].block_ids)
            for i, token in zip(live, self._argmax(rows), strict=True):
                drafts[i].append(token)
        for i in active:
            state = self._states[seqs[i].request_id]
            state.seen, state.fed = seqs[i].num_tokens, drafts[i][:-1]
        return Drafts(drafts)

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

    def _argmax(self, rows: PagedRows) -> list[int]:
        """The draft model's greedy token after each sequence's last row."""
        ids, positions, ctx = self.pool.inputs(rows)
        hidden = self.model(ids, positions, ctx)
        last = torch.tensor(rows.last_rows, device=hidden.device)
        return self.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
