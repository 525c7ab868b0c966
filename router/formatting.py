"""OpenAI response bodies and SSE chunks for chat and text completions, logprobs included.

One `ResponseFormatter` per response: it remembers whether each choice's first chunk (the chat
role, the completion's echoed prompt) was sent and the text offset of completion logprobs
across chunks. Logprobs that are not finite become -9999.0, as OpenAI does, so every body is
strict JSON.

The prompt (`PromptReturn`): completions' `echo` puts the prompt text before each choice's
text and, with `logprobs`, its tokens before the generated ones (the first with null
logprobs, each with its top entries plus the prompt token itself, as vLLM); vLLM's
`prompt_logprobs` field is a list with null for the first prompt token, then per position a
map of token id to `{logprob, rank, decoded_token}` (the prompt token first, then the top k),
in each completion choice or at the top of a chat response.
"""

from __future__ import annotations

import json
import math
from typing import Any

from common.protocol.messages import PromptLogprobs
from router.prepare import PromptReturn
from router.session import Delta, TokenPiece

SSE_DONE = "data: [DONE]\n\n"
FLOOR_LOGPROB = -9999.0


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _finite(value: float | None) -> float | None:
    if value is None:
        return None
    return value if math.isfinite(value) else FLOOR_LOGPROB


class ResponseFormatter:
    def __init__(
        self,
        kind: str,
        request_id: str,
        model: str,
        created: int,
        tokenizer: Any,
        *,
        logprobs: bool = False,
        include_usage: bool = False,
        continuous_usage: bool = False,
        prompt: PromptReturn | None = None,
    ) -> None:
        """`continuous_usage` (with `include_usage`): usage in every chunk, as vLLM's
        `continuous_usage_stats`."""
        if kind not in ("chat", "completion"):
            raise ValueError(f"kind must be 'chat' or 'completion', got {kind!r}")
        self.kind = kind
        self.request_id = request_id
        self.model = model
        self.created = created
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage
        self.prompt = prompt
        self._role_sent: set[int] = set()  # choices whose first chunk (role, echo) went out
        self._text_offset: dict[int, int] = {}  # per choice, across chunks
        self._token_text: dict[int, str] = {}

    def chunk(
        self,
        delta: Delta,
        timing: dict[str, Any] | None = None,
        usage: dict[str, int] | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> dict[str, Any] | None:
        """The stream chunk for one delta, or None when it carries nothing for the client.

        Every delta that carries tokens gets a chunk, even when its text is empty (held back
        for a stop string, an incomplete UTF-8 sequence, a possible tool call, or a model
        without a tokenizer), as vLLM does: clients time tokens by the chunks they receive.
        `usage`: the request's so far (sent with `continuous_usage`); `prompt_logprobs`: what
        an echo with logprobs shows before the first chunk's tokens."""
        first = delta.index not in self._role_sent
        text, pieces = delta.text, delta.pieces
        if self.kind == "completion" and first and self._echoes:
            text, pieces = self._echo(text, pieces, prompt_logprobs)
        if not (text or delta.finish_reason or delta.tool_calls or pieces):
            if self.kind == "completion" or not first:
                return None
        choice: dict[str, Any] = {"index": delta.index}
        if self.kind == "chat":
            body: dict[str, Any] = {"role": "assistant"} if first else {}
            if text or ((pieces or first) and not delta.tool_calls):
                body["content"] = text
            if delta.tool_calls:
                body["tool_calls"] = delta.tool_calls
            choice["delta"] = body
        else:
            choice["text"] = text
        self._role_sent.add(delta.index)
        choice["logprobs"] = self._logprobs(pieces, delta.index) if self.logprobs else None
        choice["finish_reason"] = delta.finish_reason
        out = self._envelope(
            f"{self._object()}.chunk" if self.kind == "chat" else "text_completion"
        )
        out["choices"] = [choice]
        if self.continuous_usage and usage is not None:
            out["usage"] = usage
        elif self.include_usage:
            out["usage"] = None
        if timing is not None:
            out["timing"] = timing
        return out

    def usage_chunk(self, usage: dict[str, int], timing: dict[str, Any]) -> dict[str, Any]:
        out = self._envelope(
            f"{self._object()}.chunk" if self.kind == "chat" else "text_completion"
        )
        out.update(choices=[], usage=usage, timing=timing)
        return out

    def response(
        self,
        choices: list[Delta],
        usage: dict[str, int],
        timing: dict[str, Any],
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> dict[str, Any]:
        """The whole body; each Delta holds one choice's complete text, tokens and ending;
        `prompt_logprobs`: the request's, for echo and the `prompt_logprobs` field."""
        out = self._envelope(self._object())
        out["choices"] = [self._choice(c, prompt_logprobs) for c in choices]
        wanted = self.prompt is not None and self.prompt.prompt_logprobs is not None
        if self.kind == "chat" and wanted:
            out["prompt_logprobs"] = self._prompt_logprobs_field(prompt_logprobs)
        out.update(usage=usage, timing=timing)
        return out

    def _choice(self, whole: Delta, prompt_logprobs: PromptLogprobs | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": whole.index}
        text, pieces = whole.text, whole.pieces
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            if whole.tool_calls:
                message["content"] = text if text.strip() else None
                message["tool_calls"] = [
                    {k: v for k, v in call.items() if k != "index"} for call in whole.tool_calls
                ]
            choice["message"] = message
        else:
            if self._echoes:
                text, pieces = self._echo(text, pieces, prompt_logprobs)
            choice["text"] = text
        choice["logprobs"] = self._logprobs(pieces, whole.index) if self.logprobs else None
        choice["finish_reason"] = whole.finish_reason
        if self.kind == "completion" and self.prompt and self.prompt.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs_field(prompt_logprobs)
        return choice

    def _object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    @property
    def _echoes(self) -> bool:
        return self.prompt is not None and self.prompt.echo is not None

    def _echo(
        self, text: str, pieces: list[TokenPiece], prompt_logprobs: PromptLogprobs | None
    ) -> tuple[str, list[TokenPiece]]:
        """A completion choice's text and tokens with the prompt's in front."""
        assert self.prompt is not None and self.prompt.echo is not None
        if self.logprobs:
            pieces = self._prompt_pieces(prompt_logprobs) + pieces
        return self.prompt.echo + text, pieces

    def _prompt_pieces(self, plp: PromptLogprobs | None) -> list[TokenPiece]:
        """The prompt's tokens as pieces: the first has no logprob; each other one its top
        `top_logprobs` entries, then itself unless among them (vLLM's echo)."""
        assert self.prompt is not None
        ids, k = self.prompt.token_ids, self.prompt.top_logprobs
        if plp is None:  # not computed (the node sent none): tokens without logprobs
            return [TokenPiece(t) for t in ids]
        pieces = [TokenPiece(ids[0])]
        logprobs, top_ids, top_lps = (
            a.tolist() for a in (plp.logprobs, plp.top_ids, plp.top_logprobs)
        )
        for i, token in enumerate(ids[1:]):
            row = slice(i * plp.top_k, i * plp.top_k + k)
            top = tuple(zip(top_ids[row], top_lps[row], strict=True))
            if token not in top_ids[row]:
                top += ((token, logprobs[i]),)
            pieces.append(TokenPiece(token, logprobs[i], top))
        return pieces

    def _prompt_logprobs_field(self, plp: PromptLogprobs | None) -> list[Any] | None:
        """vLLM's `prompt_logprobs`: None first, then per position {token id: entry}."""
        if plp is None:
            return None
        assert self.prompt is not None and self.prompt.prompt_logprobs is not None
        ids, k = self.prompt.token_ids, self.prompt.prompt_logprobs
        logprobs, ranks = plp.logprobs.tolist(), plp.ranks.tolist()
        top_ids, top_lps = plp.top_ids.tolist(), plp.top_logprobs.tolist()
        out: list[Any] = [None]
        for i, token in enumerate(ids[1:]):
            entries = {str(token): self._prompt_entry(token, logprobs[i], ranks[i])}
            for j in range(k):
                top = top_ids[i * plp.top_k + j]
                if str(top) not in entries:
                    entries[str(top)] = self._prompt_entry(top, top_lps[i * plp.top_k + j], j + 1)
            out.append(entries)
        return out

    def _prompt_entry(self, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": _finite(logprob), "rank": rank, "decoded_token": self._text(token_id)}

    def _logprobs(self, pieces: list[TokenPiece], index: int) -> dict[str, Any]:
        if self.kind == "chat":
            return {"content": [self._chat_entry(p) for p in pieces], "refusal": None}
        tokens, offsets = [], []
        offset = self._text_offset.get(index, 0)
        for piece in pieces:
            token = self._text(piece.token_id)
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
        self._text_offset[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(p.logprob) for p in pieces],
            "top_logprobs": [
                None if p.top is None else {self._text(t): _finite(lp) for t, lp in p.top}
                for p in pieces
            ],
            "text_offset": offsets,
        }

    def _chat_entry(self, piece: TokenPiece) -> dict[str, Any]:
        entry = self._token_entry(piece.token_id, piece.logprob)
        entry["top_logprobs"] = [self._token_entry(t, lp) for t, lp in piece.top or ()]
        return entry

    def _token_entry(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        text = self._text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    def _text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text
