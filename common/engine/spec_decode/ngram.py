"""Prompt lookup (n-gram) proposals: no second model, only the tokens so far (pure Python).

For each speculating sequence, take the longest suffix of n tokens (max_n down to min_n) that
occurred earlier in the prompt or output, and propose the tokens that followed its most recent
earlier occurrence. It pays off when the answer reuses the prompt (editing, extraction, code,
retrieval), and costs one verify row per drafted token when it guesses wrong.
"""

from __future__ import annotations

import numpy as np

from common.engine.scheduler import ScheduledBatch
from common.engine.sequence import Sequence
from common.engine.spec_decode.proposer import Drafts


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix
    of `tokens` (min_n..max_n tokens long); [] when no suffix recurs."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Starts i <= length-n-1: the occurrence is earlier and some token follows it.
        starts = np.flatnonzero(tokens[: length - n] == suffix[0])
        for j in range(1, n):
            if not starts.size:
                break
            starts = starts[tokens[starts + j] == suffix[j]]
        if starts.size:
            i = int(starts[-1])
            return tokens[i + n : i + n + k].tolist()
    return []


class NgramProposer:
    method = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        # Request id -> its tokens as an array, grown as the sequence grows (a sequence only
        # ever appends), so a step converts only its new tokens.
        self._tokens: dict[str, np.ndarray] = {}

    def propose(self, batch: ScheduledBatch, limits: list[int]) -> Drafts:
        drafts: list[list[int]] = []
        for item, k in zip(batch.items, limits, strict=True):
            drafts.append(self._propose(item.seq, k) if k > 0 else [])
        return Drafts(drafts)

    def _propose(self, seq: Sequence, k: int) -> list[int]:
        known = self._tokens.get(seq.request_id)
        n = seq.num_tokens
        if known is None or len(known) > n:
            known = np.asarray(seq.all_token_ids, dtype=np.int64)
        elif len(known) < n:
            tail = seq.output_token_ids[len(known) - len(seq.prompt_token_ids) :]
            known = np.concatenate([known, np.asarray(tail, dtype=np.int64)])
        self._tokens[seq.request_id] = known
        return lookup(known, self.min_n, self.max_n, k)

    def release(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)
