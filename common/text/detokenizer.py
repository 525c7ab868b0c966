"""Incremental detokenization with stop strings (pure Python over an HF tokenizer).

Text is released only when it is final: an incomplete UTF-8 sequence (decoded as U+FFFD) waits
for the next token, and the last `len(longest stop) - 1` characters wait until they cannot be
the start of a stop string. A matched stop string and everything after it are never released.
With `min_tokens`, stop strings are searched as vLLM does: only once more than `min_tokens`
tokens were produced, and only in the text after the first `min_tokens` tokens' (a match may
start up to `len(stop) - 1` characters before it).
"""

from __future__ import annotations

from typing import Any

# Tokens of prompt context decoded with the output, so that tokenizers which strip a leading
# space from the first token of a string still produce the space between prompt and output.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.stop = list(stop or [])
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all final output text decoded so far (stop string excluded once matched)
        self.released = 0  # characters of `text` already handed out
        self.stopped_on: str | None = None
        self.skip_special_tokens = skip_special_tokens
        self.min_tokens = min_tokens
        self.produced = 0  # output tokens added so far

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; return the text that is now safe to emit."""
        if self.stopped_on is not None:
            return ""
        new_from = len(self.text)  # the text before it was searched already
        for token in token_ids:
            self.token_ids.append(token)
            self.text += self._decode_step()
            self.produced += 1
            if self.produced <= self.min_tokens:
                new_from = len(self.text)  # never searched: the sample must go on
        if self.stop and self.produced > self.min_tokens:
            hits = [
                (i, s)
                for s in self.stop
                if (i := self.text.find(s, max(0, new_from - len(s) + 1))) >= 0
            ]
            if hits:
                index, stop = min(hits)
                self.text = self.text[:index]
                self.stopped_on = stop
                return self._release(len(self.text))
        return self._release(len(self.text) - self.hold)

    def flush(self) -> str:
        """The held-back tail, once the sequence has finished for another reason."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.released:
            return ""
        out = self.text[self.released : upto]
        self.released = upto
        return out

    def _decode_step(self) -> str:
        decode = self.tokenizer.decode
        prefix = decode(
            self.token_ids[self.prefix_offset : self.read_offset],
            skip_special_tokens=self.skip_special_tokens,
        )
        full = decode(
            self.token_ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens
        )
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return full[len(prefix) :]
        return ""
