"""OpenAI response bodies and SSE chunks for chat and text completions, logprobs included.

One `ResponseFormatter` per response: it remembers whether the chat role was sent and the
text offset of completion logprobs across chunks. Logprobs that are not finite become
-9999.0, as OpenAI does, so every body is strict JSON.
"""

from __future__ import annotations

import json
import math
from typing import Any

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
    ) -> None:
        if kind not in ("chat", "completion"):
            raise ValueError(f"kind must be 'chat' or 'completion', got {kind!r}")
        self.kind = kind
        self.request_id = request_id
        self.model = model
        self.created = created
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self.include_usage = include_usage
        self._role_sent: set[int] = set()  # choices whose first chunk (with the role) went out
        self._text_offset: dict[int, int] = {}  # per choice, across chunks
        self._token_text: dict[int, str] = {}

    def chunk(self, delta: Delta, timing: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The stream chunk for one delta, or None when it carries nothing for the client.

        Every delta that carries tokens gets a chunk, even when its text is empty (held back
        for a stop string, an incomplete UTF-8 sequence, a possible tool call, or a model
        without a tokenizer), as vLLM does: clients time tokens by the chunks they receive."""
        if not (delta.text or delta.finish_reason or delta.tool_calls or delta.pieces):
            if self.kind == "completion" or delta.index in self._role_sent:
                return None
        choice: dict[str, Any] = {"index": delta.index}
        if self.kind == "chat":
            first = delta.index not in self._role_sent
            body: dict[str, Any] = {"role": "assistant"} if first else {}
            if delta.text or ((delta.pieces or first) and not delta.tool_calls):
                body["content"] = delta.text
            if delta.tool_calls:
                body["tool_calls"] = delta.tool_calls
            self._role_sent.add(delta.index)
            choice["delta"] = body
        else:
            choice["text"] = delta.text
        choice["logprobs"] = self._logprobs(delta.pieces, delta.index) if self.logprobs else None
        choice["finish_reason"] = delta.finish_reason
        out = self._envelope(
            f"{self._object()}.chunk" if self.kind == "chat" else "text_completion"
        )
        out["choices"] = [choice]
        if self.include_usage:
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
        self, choices: list[Delta], usage: dict[str, int], timing: dict[str, Any]
    ) -> dict[str, Any]:
        """The whole body; each Delta holds one choice's complete text, tokens and ending."""
        out = self._envelope(self._object())
        out.update(choices=[self._choice(c) for c in choices], usage=usage, timing=timing)
        return out

    def _choice(self, whole: Delta) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": whole.index}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": whole.text, "refusal": None}
            if whole.tool_calls:
                message["content"] = whole.text if whole.text.strip() else None
                message["tool_calls"] = [
                    {k: v for k, v in call.items() if k != "index"} for call in whole.tool_calls
                ]
            choice["message"] = message
        else:
            choice["text"] = whole.text
        choice["logprobs"] = self._logprobs(whole.pieces, whole.index) if self.logprobs else None
        choice["finish_reason"] = whole.finish_reason
        return choice

    def _object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

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
