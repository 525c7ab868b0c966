"""Tokenizer loading and chat templating (the router and the LLM API share this)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_tokenizer(directory: Path) -> Any | None:
    """The HF tokenizer of a model directory, or None when the directory ships none."""
    if not any((directory / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def render_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text the model's own template makes of `messages` (tools and tool messages
    included, so that the template, not us, decides how they look)."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so chat messages cannot be templated")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message are exclusive")
    return tokenizer.apply_chat_template(
        messages,
        tools=tools,
        documents=documents,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
        **(template_kwargs or {}),
    )


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    add_special_tokens: bool = False,
    **options: Any,
) -> list[int]:
    """Token ids of the rendered template. The template writes the special tokens itself, so
    none are added unless asked (as HF `apply_chat_template(tokenize=True)` and vLLM do)."""
    text = render_chat_template(tokenizer, messages, **options)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
