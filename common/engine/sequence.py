"""A request's state inside one engine process (pure Python, no torch).

Ownership: `block_ids` are references this sequence holds in the process's BlockAllocator;
whoever finishes, aborts or preempts the sequence frees them exactly once (the scheduler).

Overlapped decoding: a step's sampled token reaches the host one step after the step was
launched. Until then its place in `output_token_ids` holds `PLACEHOLDER` (the next step reads
the real id on the device), and `resolve_token` writes it and applies the stop rules.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from common.engine.spec_decode.stats import SpecStats
from common.protocol.messages import PromptLogprobs
from common.protocol.sampling_params import SamplingParams

PLACEHOLDER = -1  # an output token sampled on the device, not yet on the host


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token / string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    ERROR = "error"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in this process's cache
    num_cached_tokens: int = 0  # of those, how many came from a prefix-cache hit
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of leading full blocks
    num_registered_blocks: int = 0  # leading full blocks registered in the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    num_preemptions: int = 0
    num_block_trims: int = 0  # times blocks past its tokens were given back (rejected drafts)
    # n > 1: sample `index` of request `group_id` (None: the sequence is its own request).
    group_id: str | None = None
    index: int = 0
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding's counts
    # params.prompt_logprobs: the rows computed so far, one part per prefill chunk, in prompt
    # order (common.engine.prompt_logprobs)
    prompt_logprob_parts: list[PromptLogprobs] = field(default_factory=list)

    @property
    def group(self) -> str:
        """The client's request id this sequence answers."""
        return self.group_id or self.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run through the model (the whole prompt, or the last sampled one)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def prompt_logprobs(self) -> PromptLogprobs | None:
        """Its prompt logprobs, once its whole prompt was computed; None unless asked for."""
        k = self.params.prompt_logprobs
        if k is None:
            return None
        joined = PromptLogprobs.join(self.prompt_logprob_parts, k)
        assert joined.num_rows == len(self.prompt_token_ids) - 1, "the prompt is not done"
        return joined

    def token_at(self, index: int) -> int:
        n_prompt = len(self.prompt_token_ids)
        return (
            self.prompt_token_ids[index]
            if index < n_prompt
            else self.output_token_ids[index - n_prompt]
        )

    @property
    def awaiting_last_token(self) -> bool:
        """Its last token is a placeholder and the sequence ends there whatever its value
        (max_tokens or the context limit): nothing more to compute, only to resolve."""
        p = self.params
        if not self.output_token_ids or self.output_token_ids[-1] != PLACEHOLDER:
            return False
        if p.max_tokens is not None and len(self.output_token_ids) >= p.max_tokens:
            return True
        return self.num_tokens >= self.max_model_len

    def append_token(self, token: int) -> FinishReason | None:
        """Record a sampled token and return why the sequence stops now, if it does."""
        self.output_token_ids.append(token)
        return self.resolve_token(len(self.output_token_ids) - 1, token)

    def resolve_token(self, index: int, token: int) -> FinishReason | None:
        """Write the token sampled for output position `index` (a placeholder until now) and
        return why the sequence stops there, if it does. The stop rules see the sequence as it
        was at that position, whatever placeholders follow it."""
        self.output_token_ids[index] = token
        p = self.params
        n_out = index + 1
        if n_out >= p.min_tokens:
            if token in p.stop_token_ids:
                self.stop_reason = token
                return FinishReason.STOP
            if not p.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return FinishReason.LENGTH
        if len(self.prompt_token_ids) + n_out >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def drop_unresolved(self) -> None:
        """Forget trailing placeholders (the sequence ended before their steps resolved)."""
        while self.output_token_ids and self.output_token_ids[-1] == PLACEHOLDER:
            self.output_token_ids.pop()
