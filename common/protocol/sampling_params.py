"""Per-request sampling parameters (pure Python, no torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are treated as greedy decoding.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_N = 16  # choices per request
# Integers travel to the nodes in msgpack (64 bits at most) and land in int32/int64 tensors:
# counts and top_k are bounded to int32, the seed to int64, so no value fails on the wire.
INT32_MAX = 2**31 - 1
SEED_RANGE = (-(2**63), 2**63 - 1)
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


@dataclass
class SamplingParams:
    """What to sample and when to stop, in the spirit of vLLM's `SamplingParams`.

    `top_k <= 0` disables top-k; `top_p == 1` and `min_p == 0` disable those filters.
    `logprobs=N` returns the sampled token's logprob and the N most likely tokens.
    `prompt_logprobs=K` returns, for every prompt token but the first, its logprob, its rank
    and the K most likely tokens (computed by whoever prefills, from the raw logits).
    `stop` strings are matched on decoded text by whoever detokenizes (LLM or router).
    `structured` constrains the output to a grammar (`common.engine.logits_processors`):
    `{"type": "json_object"}` or `{"type": "json_schema", "schema": "<JSON text>"}`.
    `logit_bias` is a list of `(token id, bias)` pairs added to the logits (a dict
    `{token: bias}` is accepted and converted); msgpack carries it as pairs.
    `n` samples share the prompt (the decode node forks them on the prompt's KV blocks).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: dict[str, Any] | None = None
    logit_bias: list[tuple[int, float]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):
            self.logit_bias = [(int(t), float(b)) for t, b in self.logit_bias.items()]
        elif self.logit_bias is not None:
            self.logit_bias = [(int(t), float(b)) for t, b in self.logit_bias]
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def validate(self) -> None:
        def bad(name: str, value: object, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}")

        for name in FLOAT_FIELDS:  # NaN passes every range check written as `not a <= x`
            value = getattr(self, name)
            if not math.isfinite(value):
                raise bad(name, value, "a finite number")
        if not 1 <= self.n <= MAX_N:
            raise bad("n", self.n, f"in [1, {MAX_N}]")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", self.temperature, "in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not -1 <= self.top_k <= INT32_MAX:
            raise bad("top_k", self.top_k, f"-1, 0 (disabled) or in [1, {INT32_MAX}]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "> 0")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= INT32_MAX:
            raise bad("max_tokens", self.max_tokens, f"in [1, {INT32_MAX}]")
        if not 0 <= self.min_tokens <= INT32_MAX:
            raise bad("min_tokens", self.min_tokens, f"in [0, {INT32_MAX}]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise bad("seed", self.seed, "a 64-bit signed integer")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", self.logprobs, f"in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad("prompt_logprobs", self.prompt_logprobs, f"in [0, {MAX_LOGPROBS}]")
        if any(not isinstance(t, int) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "token ids (int32, >= 0)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "non-empty strings")
        if self.logit_bias and any(
            not 0 <= t <= INT32_MAX or not -100 <= b <= 100 for t, b in self.logit_bias
        ):
            raise bad("logit_bias", self.logit_bias, "token ids >= 0 with biases in [-100, 100]")
        if self.structured is not None and (
            not isinstance(self.structured, dict)
            or self.structured.get("type") not in ("json_object", "json_schema")
        ):
            raise bad("structured", self.structured, "a json_object or json_schema spec")

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )
