"""Per-request logits processors applied before sampling: grammar masks (structured outputs,
forced tool calls) and `logit_bias`, on the [rows, V] logits the runner is about to sample.

Grammars are compiled by xgrammar once per distinct spec. Contract: a request's matcher is
caught up from `seq.output_token_ids` before its mask is filled, so it needs no hook after
sampling and a request whose first tokens were sampled in another process resumes by replaying
them; hence `EngineCore` runs steps synchronously (no placeholder tokens) while a grammar
request is scheduled. Masks are filled on the host into one int32 bitmask per batch, copied to
the device once and applied in place.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import torch

from common.engine.device_copy import to_device_from
from common.engine.sequence import PLACEHOLDER, Sequence
from common.protocol.sampling_params import SamplingParams
from common.protocol.structured import check_structured

log = logging.getLogger(__name__)


class LogitsProcessors:
    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: Seq[int]
    ) -> None:
        # Called for the first grammar: a node loads its tokenizer only if it needs one.
        self.load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: Any = None  # built on the first structured request
        self._grammars: dict[str, Any] = {}
        self._matchers: dict[str, tuple[Any, int]] = {}  # request id -> (matcher, tokens fed)
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher, built on first use

    def check(self, params: SamplingParams) -> None:
        """Compile the request's grammar now (admission), so a bad one fails only itself."""
        if params.structured is not None:
            self._grammar(params.structured)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Mask and bias the rows of `logits` [len(seqs), V] whose requests ask for it.
        Returns `logits`, or a float32 copy when some row was processed."""
        return self.apply_drafts(logits, seqs, [[] for _ in seqs])

    def apply_drafts(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]
    ) -> torch.Tensor:
        """Speculative verify: `logits` has sum(len(d) + 1) rows, sequence i's consecutive, its
        row j scoring the token after its output + drafts[i][:j]. Each row is masked and biased
        as `apply` would after that prefix had been accepted; the matchers end where they began.

        After a draft the grammar refuses (or one that ends the grammar) the later rows of that
        sequence stay unmasked: the row before masks the draft out (or lets only a stop token
        through), so the verifier never reaches them, and an unmasked row is what `apply` gives
        a terminated matcher."""
        if len(drafts) != len(seqs):
            raise ValueError(f"{len(drafts)} draft lists for {len(seqs)} sequences")
        counts = [len(d) + 1 for d in drafts]
        if sum(counts) != logits.shape[0]:
            raise ValueError(f"logits have {logits.shape[0]} rows, drafts need {sum(counts)}")
        starts = [0]
        for count in counts[:-1]:
            starts.append(starts[-1] + count)
        constrained = [i for i, s in enumerate(seqs) if s.params.structured is not None]
        biased = [i for i, s in enumerate(seqs) if s.params.logit_bias]
        if not constrained and not biased:
            return logits
        logits = logits.float()
        if constrained:
            self._apply_grammar(logits, seqs, drafts, starts, constrained)
        if biased:
            row_seqs = [seq for seq, count in zip(seqs, counts, strict=True) for _ in range(count)]
            rows = [starts[i] + j for i in biased for j in range(counts[i])]
            self._apply_bias(logits, row_seqs, rows)
        return logits

    def _apply_grammar(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        drafts: list[list[int]],
        starts: list[int],
        constrained: list[int],
    ) -> None:
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        matchers = {i: m for i in constrained if (m := self._caught_up(seqs[i])) is not None}
        fed = dict.fromkeys(matchers, 0)  # drafts each matcher accepted: rolled back below
        live, applied, depth = dict(matchers), [], 0
        try:
            # One batched fill per draft depth: the rows at one depth are distinct matchers.
            while live:
                live = {i: m for i, m in live.items() if not m.is_terminated()}
                indices = [starts[i] + depth for i in live]
                if indices:
                    if self._batch is None:  # fills the rows' masks on a pool of threads
                        self._batch = xgr.BatchGrammarMatcher(max_threads="auto")
                    self._batch.batch_fill_next_token_bitmask(
                        list(live.values()), bitmask, indices=indices
                    )
                    applied.extend(indices)
                advanced = {}
                for i, matcher in live.items():
                    if depth < len(drafts[i]) and matcher.accept_token(drafts[i][depth]):
                        fed[i] += 1
                        advanced[i] = matcher
                live, depth = advanced, depth + 1
        finally:
            for i, n in fed.items():
                if n:
                    matchers[i].rollback(n)
        if applied:
            mask = to_device_from(bitmask, logits.device)
            xgr.apply_token_bitmask_inplace(
                logits, mask, vocab_size=min(self.vocab_size, logits.shape[1]), indices=applied
            )

    def _caught_up(self, seq: Sequence) -> Any:
        import xgrammar as xgr

        rid = seq.request_id
        if rid in self._matchers:
            matcher, fed = self._matchers[rid]
            if matcher is None:
                return None
        else:
            matcher, fed = xgr.GrammarMatcher(self._grammar(seq.params.structured)), 0
        for token in seq.output_token_ids[fed:]:
            assert token != PLACEHOLDER, "grammar rows run synchronously (EngineCore)"
            if not matcher.accept_token(token):
                # Cannot happen for tokens sampled under the mask; a token from elsewhere
                # that breaks the grammar leaves the request unconstrained, not the step dead.
                log.warning("request %s: token %d breaks its grammar; unconstraining", rid, token)
                self._matchers[rid] = (None, len(seq.output_token_ids))
                return None
        self._matchers[rid] = (matcher, len(seq.output_token_ids))
        return matcher

    def _apply_bias(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        vocab = logits.shape[1]
        index_rows, cols, values = [], [], []
        for row in rows:
            for token, bias in seqs[row].params.logit_bias:
                if 0 <= token < vocab:
                    index_rows.append(row)
                    cols.append(token)
                    values.append(bias)
        device = logits.device
        logits.index_put_(
            (torch.tensor(index_rows, device=device), torch.tensor(cols, device=device)),
            torch.tensor(values, dtype=logits.dtype, device=device),
            accumulate=True,
        )

    def _grammar(self, spec: dict[str, Any]) -> Any:
        key = json.dumps(spec, sort_keys=True)
        grammar = self._grammars.get(key)
        if grammar is None:
            check_structured(spec)
            compiler = self._grammar_compiler()
            if spec["type"] == "json_object":
                # Any object; compact (no free whitespace): a model cannot pad forever.
                grammar = compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            else:  # strict: no properties the schema does not name
                grammar = compiler.compile_json_schema(spec["schema"], any_whitespace=False)
            self._grammars[key] = grammar
        return grammar

    def _grammar_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            tokenizer = self.load_tokenizer()
            if tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer")
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler
