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


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so chat messages cannot be templated")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
