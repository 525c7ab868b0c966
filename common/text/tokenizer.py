"""Tokenizer loading and chat templating (the router and the LLM API share this)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from common import envs

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_tokenizer(directory: Path) -> Any | None:
    """The HF tokenizer of a model directory, or None when the directory ships none.

    AutoTokenizer picks the class, but to do so it reads the model's config through
    AutoConfig, which imports torch and much of transformers: about 5 s of CPU, the longest
    part of a router's start on a small machine. Its pick is remembered per tokenizer (under
    `envs.cache_dir()`, keyed by the tokenizer's files and the transformers version), and a
    later load takes that class straight away, as AutoTokenizer itself finally does."""
    if not any((directory / name).exists() for name in TOKENIZER_FILES):
        return None
    import transformers

    key = _fingerprint(directory, transformers.__version__)
    known = _remembered_classes().get(key)
    tokenizer_class = getattr(transformers, known, None) if isinstance(known, str) else None
    if tokenizer_class is not None:
        return tokenizer_class.from_pretrained(str(directory))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    picked = type(tokenizer)
    if getattr(transformers, picked.__name__, None) is picked:  # not a remote-code class
        _remember_class(key, picked.__name__)
    return tokenizer


def _fingerprint(directory: Path, version: str) -> str:
    digest = hashlib.sha256(f"{directory.resolve()}\0{version}".encode())
    for name in (*TOKENIZER_FILES, "config.json", "special_tokens_map.json"):
        path = directory / name
        if path.exists():
            stat = path.stat()
            digest.update(f"\0{name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def _classes_file() -> Path:
    return envs.cache_dir() / "tokenizer_classes.json"


def _remembered_classes() -> dict[str, Any]:
    try:
        known = json.loads(_classes_file().read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _remember_class(key: str, class_name: str) -> None:
    """Best effort: a cache that cannot be written only costs the next load its seconds."""
    known = _remembered_classes()
    known[key] = class_name
    path = _classes_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(known))
        temporary.replace(path)  # atomic: concurrent loaders never read half a file
    except OSError:
        pass


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
