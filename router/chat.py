"""Chat messages as the model's chat template expects them, and the prompt it renders.

Nothing is flattened: assistant `tool_calls` (arguments as objects, as HF templates read them),
`tool` results with their `tool_call_id`, names and `reasoning_content` all reach the template,
and the template decides how they look in the prompt.
"""

from __future__ import annotations

import json
from typing import Any

from common.text.tokenizer import apply_chat_template
from router.errors import invalid
from router.protocol import ChatCompletionRequest, ChatMessage, TextPart, Tool

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    if not messages:
        raise invalid("messages must be a non-empty list", "messages")
    return [_template_message(i, m) for i, m in enumerate(messages)]


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [t.model_dump(exclude_none=True, by_alias=True) for t in tools]


def chat_prompt_ids(
    req: ChatCompletionRequest, tokenizer: Any, tools: list[dict[str, Any]] | None
) -> list[int]:
    """Token ids of the rendered conversation; a template error is a 400 on `messages`."""
    add_generation_prompt = req.add_generation_prompt
    if add_generation_prompt is None:
        add_generation_prompt = not req.continue_final_message
    messages = template_messages(req.messages)  # first: it refuses an empty list
    if req.continue_final_message and req.messages[-1].role != "assistant":
        raise invalid(
            "continue_final_message needs an assistant message last", "continue_final_message"
        )
    try:
        return apply_chat_template(
            tokenizer,
            messages,
            tools=tools,
            documents=req.documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=bool(req.continue_final_message),
            chat_template=req.chat_template,
            template_kwargs=req.chat_template_kwargs,
            add_special_tokens=bool(req.add_special_tokens),
        )
    except ValueError as exc:
        if "exclusive" in str(exc):
            raise invalid(str(exc), "continue_final_message") from None
        raise invalid(f"cannot apply the chat template: {exc}", "messages") from None
    except Exception as exc:  # jinja errors, a template that raises on purpose
        raise invalid(f"cannot apply the chat template: {exc}", "messages") from None


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    role = message.role
    if role not in ROLES:
        raise invalid(
            f"messages[{index}].role must be one of {sorted(ROLES)}, got {role!r}", "messages"
        )
    out: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": _text(message.content),
    }
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        if role != "assistant":
            raise invalid(
                f"messages[{index}]: only assistant messages carry tool_calls", "messages"
            )
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(index, call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    return out


def _text(content: str | list[TextPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def _arguments(index: int, arguments: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise invalid(
            f"messages[{index}].tool_calls: function.arguments must be a JSON object string",
            "messages",
        )
    return parsed
