"""From a validated OpenAI request to prompt token ids and `SamplingParams`, or a 400/404.

Two steps: `prepare_chat` / `prepare_completion` need only the tokenizer; `apply_limits` needs
the context length and vocabulary of the nodes chosen for the request (known from their
heartbeats), checks the prompt against them and fills the default `max_tokens`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.sampling_params import MAX_LOGPROBS, SamplingParams
from common.tokenizer import apply_chat_template
from router.errors import OpenAIError, invalid
from router.protocol import ChatCompletionRequest, CompletionRequest, _GenerationFields

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
SEED_RANGE = (-(2**63), 2**63 - 1)  # what msgpack and torch generators accept


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class PreparedRequest:
    kind: str  # "chat" | "completion"
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens stays None until apply_limits when the client gave none
    stream: bool
    include_usage: bool
    return_logprobs: bool  # the client asked for per-token logprobs

    @property
    def prompt_field(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"


def check_model(requested: str | None, names: Sequence[str]) -> None:
    """`names[0]` is the served name, the rest accepted aliases; `None` means the served model."""
    if requested is not None and requested not in names:
        raise OpenAIError(
            404,
            f"The model `{requested}` does not exist; this server serves `{names[0]}`.",
            param="model",
            code="model_not_found",
        )


def prepare_chat(req: ChatCompletionRequest, tokenizer: Any) -> PreparedRequest:
    if not req.messages:
        raise invalid("messages must be a non-empty list", "messages")
    messages = [_template_message(i, m.role, m.content) for i, m in enumerate(req.messages)]
    try:
        ids = apply_chat_template(tokenizer, messages)
    except Exception as exc:  # jinja errors, a missing template, a missing tokenizer
        raise invalid(f"cannot apply the chat template: {exc}", "messages") from None
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise invalid(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    return _prepared("chat", ids, req, max_tokens, logprobs)


def prepare_completion(req: CompletionRequest, tokenizer: Any) -> PreparedRequest:
    if req.echo:
        raise invalid("echo is not supported", "echo")
    if req.suffix:
        raise invalid("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != 1:
        raise invalid("best_of must be 1 (several candidates are not supported)", "best_of")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise invalid(f"one prompt per request is supported, got {len(prompt)}", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise invalid("this model has no tokenizer: send the prompt as token ids", "prompt")
        ids = list(tokenizer.encode(prompt, add_special_tokens=True))
    else:
        ids = list(prompt)
    return _prepared("completion", ids, req, req.max_tokens, req.logprobs)


def apply_limits(prepared: PreparedRequest, limits: ModelLimits) -> PreparedRequest:
    ids, field = prepared.prompt_token_ids, prepared.prompt_field
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise invalid(f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})", field)
    params = prepared.params
    bad = next((t for t in params.stop_token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise invalid(
            f"stop token id {bad} is outside the vocabulary [0, {limits.vocab_size})",
            "stop_token_ids",
        )
    context, n = limits.max_model_len, len(ids)
    if n >= context:
        raise invalid(
            f"This model's maximum context length is {context} tokens, but the prompt has {n} "
            f"tokens (at least one token of room for the completion is needed).",
            field,
        )
    if params.max_tokens is None:
        params = dataclasses.replace(params, max_tokens=context - n)
    elif n + params.max_tokens > context:
        raise invalid(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{n + params.max_tokens} tokens ({n} in the {field}, {params.max_tokens} in the "
            f"completion). Please reduce the length of the {field} or the completion.",
            "max_tokens",
        )
    return dataclasses.replace(prepared, params=params)


def _template_message(index: int, role: str, content: Any) -> dict[str, str]:
    if role not in ROLES:
        raise invalid(
            f"messages[{index}].role must be one of {sorted(ROLES)}, got {role!r}", "messages"
        )
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(
                    f"messages[{index}].content: only text parts are supported, got {part.get('type')!r}",
                    "messages",
                )
            texts.append(part["text"])
        text = "\n".join(texts)
    return {"role": "system" if role == "developer" else role, "content": text}


def _prepared(
    kind: str,
    ids: list[int],
    req: _GenerationFields,
    max_tokens: int | None,
    logprobs: int | None,
) -> PreparedRequest:
    if not ids:
        raise invalid("the prompt is empty", "messages" if kind == "chat" else "prompt")
    if req.seed is not None and not SEED_RANGE[0] <= req.seed <= SEED_RANGE[1]:
        raise invalid(f"seed must be a 64-bit signed integer, got {req.seed}", "seed")
    if max_tokens is not None and req.min_tokens is not None and req.min_tokens > max_tokens:
        raise invalid(
            f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})",
            "min_tokens",
        )
    options = {
        "n": req.n,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "seed": req.seed,
        "repetition_penalty": req.repetition_penalty,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "min_tokens": req.min_tokens,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
    }
    given = {k: v for k, v in options.items() if v is not None}
    try:
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **given)
    except ValueError as exc:
        raise invalid(str(exc), _param_named_in(str(exc))) from None
    stream = bool(req.stream)
    include_usage = stream and bool(req.stream_options and req.stream_options.include_usage)
    return PreparedRequest(kind, ids, params, stream, include_usage, logprobs is not None)


def _param_named_in(message: str) -> str | None:
    """SamplingParams errors start with the field name ("top_p must be ...")."""
    name = message.split(" ", 1)[0]
    return name if name.isidentifier() else None
