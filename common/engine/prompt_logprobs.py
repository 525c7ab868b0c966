"""Prompt logprobs (vLLM's `prompt_logprobs`), computed chunk by chunk as the prompt prefills.

The hidden state at prompt position p gives the distribution of prompt token p + 1. Each step
projects only its own prompt chunks' rows onto the vocabulary, at most `MAX_ROWS` rows per
projection, so prompt x vocabulary logits never exist at once; per row it keeps the prompt
token's logprob and rank and the k most likely tokens, one `PromptLogprobs` part per chunk in
`Sequence.prompt_logprob_parts`. Raw logits, as vLLM: no temperature, penalty, bias or grammar.

Contract: such a sequence computes its prompt from position 0 (the scheduler matches no cached
prefix for it), so its rows come in order. Rows it already has (a recompute after preemption)
are not computed again; a sequence that starts past its rows (an n > 1 sample forked on its
parent's prompt blocks) computes none. The parts reach the host before the step returns: a
step with such rows gives up its overlap with the next one (requests that ask are scoring
runs, not latency-bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.scheduler import ScheduledBatch
from common.engine.sequence import Sequence
from common.model.registry import CausalLM
from common.protocol.messages import PromptLogprobs

MAX_ROWS = 512  # rows per logits projection: 512 x vocabulary float32 at most at a time


@dataclass(frozen=True)
class PromptRows:
    """Rows of one step's hidden states whose next prompt token's logprob is wanted."""

    seq: Sequence
    hidden_row: int  # first row among the step's hidden states
    position: int  # its prompt position
    count: int


def prompt_rows(batch: ScheduledBatch) -> list[PromptRows]:
    """The rows of `batch` to collect, in hidden-state order (a verify item has one row per
    verified token, every other item one per new token)."""
    rows: list[PromptRows] = []
    at = 0
    for i, item in enumerate(batch.items):
        drafts = batch.drafts_of(i)
        seq = item.seq
        if seq.params.prompt_logprobs is not None and not drafts:
            done = sum(part.num_rows for part in seq.prompt_logprob_parts)
            first = max(item.start, done)
            end = min(item.start + item.num_new_tokens, len(seq.prompt_token_ids) - 1)
            if item.start <= done and first < end:
                rows.append(PromptRows(seq, at + first - item.start, first, end - first))
        at += 1 + len(drafts) if drafts else item.num_new_tokens
    return rows


def collect(model: CausalLM, hidden: torch.Tensor, rows: list[PromptRows]) -> None:
    """Append each `PromptRows`' logprobs to its sequence; `hidden`: the step's final hidden
    states, one row per token (what `compute_logits` takes)."""
    for r in rows:
        k = r.seq.params.prompt_logprobs
        prompt = r.seq.prompt_token_ids
        for s in range(0, r.count, MAX_ROWS):
            m = min(MAX_ROWS, r.count - s)
            p = r.position + s
            targets = torch.tensor(prompt[p + 1 : p + 1 + m], device=hidden.device)
            logits = model.compute_logits(hidden[r.hidden_row + s : r.hidden_row + s + m])
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            chosen = logprobs.gather(1, targets[:, None])
            ranks = (logprobs > chosen).sum(dim=-1) + 1
            top_logprobs, top_ids = logprobs.topk(k, dim=-1)
            part = PromptLogprobs(
                k,
                chosen.squeeze(1).cpu().numpy(),
                ranks.to(torch.int32).cpu().numpy(),
                top_ids.flatten().to(torch.int32).cpu().numpy(),
                top_logprobs.flatten().cpu().numpy(),
            )
            r.seq.prompt_logprob_parts.append(part)
