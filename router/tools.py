"""Tool calling: which tools a request offers, how the model's text becomes `tool_calls`.

`plan_tools` reads `tools` / `tool_choice` / `parallel_tool_calls`. With `auto` the model
decides and its text is parsed; `required` and a named function are enforced by a grammar
(`grammar_schema`: an array of calls, or the named function's arguments), so their output is
JSON that always parses. `none` offers no tools to the template and parses nothing.

Parsers (`--tool-call-parser`, `auto` picks from the chat template): `hermes`, the
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of Hermes, Qwen2.5 and Qwen3;
`llama3_json`, Llama 3.1's bare JSON calls (`{"name": ..., "parameters": {...}}`, optionally
after `<|python_tag|>`, several separated by `;`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from router.chat import template_tools
from router.errors import invalid
from router.protocol import ChatCompletionRequest

PARSERS = ("auto", "hermes", "llama3_json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "auto" | "required" | "named"
    tools: list[dict[str, Any]]  # as the chat template gets them
    parser: str  # "hermes" | "llama3_json"
    function: str | None = None  # the named function
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")


def pick_parser(configured: str, tokenizer: Any) -> str:
    if configured != "auto":
        return configured
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if HERMES_OPEN not in template and (PYTHON_TAG in template or "ipython" in template):
        return "llama3_json"
    return "hermes"


def plan_tools(req: ChatCompletionRequest, parser: str) -> ToolPlan | None:
    """None when no tool may be called (no tools, or tool_choice "none")."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    tools = template_tools(req.tools)
    names = [t.function.name for t in req.tools]
    parallel = req.parallel_tool_calls is not False
    if choice is None or choice == "auto":
        return ToolPlan("auto", tools, parser, parallel=parallel)
    if choice == "required":
        return ToolPlan("required", tools, parser, parallel=parallel)
    if choice.function.name not in names:
        raise invalid(
            f"tool_choice names {choice.function.name!r}, which is not among the tools {names}",
            "tool_choice",
        )
    return ToolPlan("named", tools, parser, function=choice.function.name, parallel=parallel)


def grammar_schema(plan: ToolPlan) -> dict[str, Any]:
    """The JSON schema the output of a `required` / named-function request must follow."""
    by_name = {t["function"]["name"]: t["function"] for t in plan.tools}
    if plan.mode == "named":
        return _parameters(by_name[plan.function])
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": _parameters(fn)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, fn in by_name.items()
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not plan.parallel:
        schema["maxItems"] = 1
    return schema


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def tool_call(name: str, arguments: Any, index: int) -> dict[str, Any]:
    """One OpenAI `tool_calls` entry; arguments become a JSON string."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "index": index,
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": text},
    }


@dataclass
class ToolCallStream:
    """Turns the model's text, as it streams, into content deltas and finished tool calls.

    `feed(text)` returns (content to show now, calls completed now); `finish()` the rest.
    Content that might be the start of a tool call is held back until it is known not to be.
    """

    plan: ToolPlan
    _buffer: str = ""
    _in_calls: bool = False  # past the first tool call marker: nothing more is content
    _started: bool = False  # llama3_json: the output began as plain text
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._buffer += text
        if self.plan.constrained:
            return "", []  # the whole output is JSON: parsed at the end
        if self.plan.parser == "llama3_json":
            return self._feed_llama(), []
        return self._feed_hermes()

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        rest, self._buffer = self._buffer, ""
        if self.plan.constrained:
            return "", self._add(_constrained_calls(self.plan, rest))
        if self.plan.parser == "llama3_json":
            if self._in_calls:
                calls = _llama_calls(rest)
                return ("", self._add(calls)) if calls else (rest, [])
            return rest, []
        if not self._in_calls:
            return rest, []
        calls = _hermes_calls(rest, allow_unclosed=True)
        return ("", self._add(calls)) if calls is not None else (rest, [])

    def _feed_hermes(self) -> tuple[str, list[dict[str, Any]]]:
        out = ""
        if not self._in_calls:
            start = self._buffer.find(HERMES_OPEN)
            if start < 0:
                keep = _partial_suffix(self._buffer, HERMES_OPEN)
                out, self._buffer = (
                    self._buffer[: len(self._buffer) - keep],
                    self._buffer[len(self._buffer) - keep :],
                )
                return out, []
            out, self._buffer, self._in_calls = self._buffer[:start], self._buffer[start:], True
        done = []
        while (end := self._buffer.find(HERMES_CLOSE)) >= 0:
            block, self._buffer = (
                self._buffer[: end + len(HERMES_CLOSE)],
                self._buffer[end + len(HERMES_CLOSE) :],
            )
            done += _hermes_calls(block, allow_unclosed=False) or []
        return out, self._add(done)

    def _feed_llama(self) -> str:
        if self._in_calls:
            return ""
        if not self._started:
            stripped = self._buffer.lstrip()
            if stripped.startswith(("{", PYTHON_TAG)):
                self._in_calls = True
                return ""
            if not stripped or PYTHON_TAG.startswith(stripped):
                return ""  # undecided yet
            self._started = True  # plain text first: all of it is content
        out, self._buffer = self._buffer, ""
        return out

    def _add(self, calls: list[tuple[str, Any]]) -> list[dict[str, Any]]:
        made = [tool_call(name, args, len(self.calls) + i) for i, (name, args) in enumerate(calls)]
        self.calls += made
        return made


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _hermes_calls(text: str, allow_unclosed: bool) -> list[tuple[str, Any]] | None:
    """Calls in `<tool_call>` blocks; None if a block is not a valid call."""
    calls = []
    for body in _HERMES_BLOCK.findall(text):
        call = _json_call(body, ("arguments", "parameters"))
        if call is None:
            return None
        calls.append(call)
    if not allow_unclosed and not calls:
        return None
    return calls


def _llama_calls(text: str) -> list[tuple[str, Any]]:
    text = text.strip().removeprefix(PYTHON_TAG).strip()
    calls = []
    for part in _split_json_objects(text):
        call = _json_call(part, ("parameters", "arguments"))
        if call is None:
            return []
        calls.append(call)
    return calls


def _split_json_objects(text: str) -> list[str]:
    decoder, parts, i = json.JSONDecoder(), [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\n;":
            i += 1
        if i >= len(text):
            break
        try:
            _, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return [text[i:]]
        parts.append(text[i:end])
        i = end
    return parts


def _json_call(body: str, keys: tuple[str, ...]) -> tuple[str, Any] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in keys if k in obj), {})
    return obj["name"], arguments


def _constrained_calls(plan: ToolPlan, text: str) -> list[tuple[str, Any]]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []  # cut by max_tokens: the grammar could not finish
    if plan.mode == "named":
        return [(plan.function, value)]
    return [(c["name"], c["arguments"]) for c in value if isinstance(c, dict) and "name" in c]


class ToolShaper:
    """Applies a `ToolPlan` to each choice's deltas: content and `tool_calls` out of the text,
    and `finish_reason` "tool_calls" when a choice that stopped by itself called a tool."""

    def __init__(self, plan: ToolPlan | None) -> None:
        self.plan = plan
        self.streams: dict[int, ToolCallStream] = {}

    def shape(self, delta: Any) -> Any:
        """The delta as the client sees it (a new one when tools are in play)."""
        if self.plan is None:
            return delta
        stream = self.streams.setdefault(delta.index, ToolCallStream(self.plan))
        text, calls = stream.feed(delta.text)
        reason = delta.finish_reason
        if reason is not None:
            more_text, more_calls = stream.finish()
            text, calls = text + more_text, calls + more_calls
            if stream.calls and reason == "stop":
                reason = "tool_calls"
        return type(delta)(text, delta.pieces, reason, delta.index, calls or None)
