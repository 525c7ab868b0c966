"""From a validated OpenAI request to prompt token ids and `SamplingParams`, or a 400/404.

Two steps: `prepare_chat` / `prepare_completion` need only the tokenizer; `apply_limits` needs
the context length and vocabulary of the nodes chosen for the request (known from their
heartbeats), checks the prompt against them and fills the default `max_tokens`. Every field
that would change the output is honoured here or refused with a 400 that names it
(`refuse_unsupported`); none is dropped on the floor.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from common.protocol.sampling_params import MAX_LOGPROBS, SamplingParams
from common.protocol.structured import check_structured
from router.chat import chat_prompt_ids
from router.errors import OpenAIError, invalid
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
    _GenerationFields,
)
from router.tools import ToolPlan, grammar_schema, plan_tools


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class PromptReturn:
    """What the response carries about the prompt: completions' `echo` and vLLM's
    `prompt_logprobs` (the node computes them when `SamplingParams.prompt_logprobs` is set)."""

    token_ids: list[int]
    echo: str | None = None  # text put before each completion choice's text
    top_logprobs: int = 0  # top entries per echoed prompt token (the request's `logprobs`)
    prompt_logprobs: int | None = None  # top entries per position of the `prompt_logprobs` field


@dataclass(frozen=True)
class PreparedRequest:
    kind: str  # "chat" | "completion"
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens stays None until apply_limits when the client gave none
    stream: bool
    include_usage: bool
    return_logprobs: bool  # the client asked for per-token logprobs
    skip_special_tokens: bool = True
    tools: ToolPlan | None = None  # how the text becomes tool calls (chat with tools only)
    continuous_usage: bool = False  # usage in every chunk (vLLM's continuous_usage_stats)
    # False for max_tokens 0: the nodes sample one token (max_tokens 1) the client never sees
    generates: bool = True
    prompt: PromptReturn | None = None  # echo or prompt_logprobs asked

    @property
    def prompt_field(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"


def _unset(value: Any) -> bool:
    return value is None


def _false(value: Any) -> bool:
    return not value


# (field, neutral value test, what to do instead). A field here is accepted only at its
# neutral value, anything else is a 400 naming it: pdserve does not implement it.
UNSUPPORTED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("best_of", lambda v: v in (None, 1), "several candidates per choice are not supported"),
    ("use_beam_search", _false, "beam search is not supported"),
    ("length_penalty", lambda v: v in (None, 1.0), "length_penalty needs beam search"),
    ("include_stop_str_in_output", _false, "stop strings are never included in the output"),
    ("spaces_between_special_tokens", lambda v: v in (None, True), "it must be true"),
    ("truncate_prompt_tokens", _unset, "prompts are never truncated; shorten the prompt"),
    ("guided_json", _unset, "use response_format json_schema"),
    ("guided_regex", _unset, "regex constraints are not supported"),
    ("guided_choice", _unset, "use response_format json_schema with an enum"),
    ("guided_grammar", _unset, "grammar constraints are not supported"),
    ("structured_outputs", _unset, "use response_format"),
    ("functions", _unset, "use tools"),
    ("function_call", _unset, "use tool_choice"),
    ("modalities", lambda v: v in (None, ["text"]), "only text output is supported"),
    ("audio", _unset, "audio output is not supported"),
    ("prediction", _unset, "predicted outputs are not supported"),
    ("reasoning_effort", _unset, "use chat_template_kwargs (for Qwen3: enable_thinking)"),
    ("web_search_options", _unset, "web search is not supported"),
    ("mm_processor_kwargs", _unset, "multimodal inputs are not supported"),
    ("suffix", _false, "suffix (insertion) is not supported"),
)


def refuse_unsupported(req: _GenerationFields) -> None:
    for name, neutral, hint in UNSUPPORTED:
        value = getattr(req, name, None)
        if not neutral(value):
            raise invalid(f"{name} is not supported by pdserve: {hint}", name)


def check_model(requested: str | None, names: Sequence[str]) -> None:
    """`names[0]` is the served name, the rest accepted aliases; `None` means the served model."""
    if requested is not None and requested not in names:
        raise OpenAIError(
            404,
            f"The model `{requested}` does not exist; this server serves `{names[0]}`.",
            param="model",
            code="model_not_found",
        )


def prepare_chat(
    req: ChatCompletionRequest, tokenizer: Any, tool_parser: str = "hermes"
) -> PreparedRequest:
    refuse_unsupported(req)
    if req.echo:
        raise invalid("echo is not supported by pdserve for chat completions", "echo")
    tools = plan_tools(req, tool_parser)
    ids = chat_prompt_ids(req, tokenizer, tools.tools if tools else None)
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise invalid(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    structured = None
    if tools is not None and tools.constrained:
        if _structured(req) is not None:
            raise invalid(
                "response_format cannot be combined with a forced tool_choice", "response_format"
            )
        structured = {"type": "json_schema", "schema": json.dumps(grammar_schema(tools))}
    prepared = _prepared("chat", ids, req, max_tokens, logprobs, structured)
    return dataclasses.replace(prepared, tools=tools)


def prepare_completion(req: CompletionRequest, tokenizer: Any) -> PreparedRequest:
    refuse_unsupported(req)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise invalid(f"one prompt per request is supported, got {len(prompt)}", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise invalid("this model has no tokenizer: send the prompt as token ids", "prompt")
        add_special = req.add_special_tokens is not False
        ids = list(tokenizer.encode(prompt, add_special_tokens=add_special))
    else:
        ids = list(prompt)
    echo = None
    if req.echo:
        if tokenizer is None:
            raise invalid("echo needs the model's tokenizer, which this model lacks", "echo")
        echo = prompt if isinstance(prompt, str) else tokenizer.decode(ids)
    return _prepared("completion", ids, req, req.max_tokens, req.logprobs, echo=echo)


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
    bad = next((t for t, _ in params.logit_bias or () if t >= limits.vocab_size), None)
    if bad is not None:
        raise invalid(
            f"logit_bias token id {bad} is outside the vocabulary [0, {limits.vocab_size})",
            "logit_bias",
        )
    context, n = limits.max_model_len, len(ids)
    if n >= context:
        raise invalid(
            f"This model's maximum context length is {context} tokens, but the prompt has {n} "
            f"tokens (at least one token of room for the completion is needed).",
            field,
        )
    if params.max_tokens is None:
        if params.min_tokens > context - n:  # checked by SamplingParams when max_tokens is given
            raise invalid(
                f"min_tokens ({params.min_tokens}) must not exceed max_tokens, which defaults to "
                f"the {context - n} tokens of context left after the prompt",
                "min_tokens",
            )
        params = dataclasses.replace(params, max_tokens=context - n)
    elif n + params.max_tokens > context:
        raise invalid(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{n + params.max_tokens} tokens ({n} in the {field}, {params.max_tokens} in the "
            f"completion). Please reduce the length of the {field} or the completion.",
            "max_tokens",
        )
    return dataclasses.replace(prepared, params=params)


def _prepared(
    kind: str,
    ids: list[int],
    req: _GenerationFields,
    max_tokens: int | None,
    logprobs: int | None,
    structured: dict[str, Any] | None = None,
    echo: str | None = None,
) -> PreparedRequest:
    """`echo`: the prompt text a completion's `echo` puts before its text."""
    if not ids:
        raise invalid("the prompt is empty", "messages" if kind == "chat" else "prompt")
    if max_tokens is not None and max_tokens < 0:
        raise invalid(f"max_tokens must be >= 0, got {max_tokens}", "max_tokens")
    generates = max_tokens != 0
    if not generates and req.min_tokens:
        raise invalid(f"min_tokens must be <= max_tokens (0), got {req.min_tokens}", "min_tokens")
    if req.prompt_logprobs is not None and req.stream:
        raise invalid("prompt_logprobs are not available when stream is true", "prompt_logprobs")
    prompt = None
    if echo is not None or req.prompt_logprobs is not None:
        prompt = PromptReturn(ids, echo, logprobs or 0, req.prompt_logprobs)
    fields = {
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
        "structured": structured or _structured(req),
        "logit_bias": _logit_bias(req.logit_bias),
        "prompt_logprobs": _prompt_logprobs(req.prompt_logprobs, logprobs, echo is not None),
    }
    given = {k: v for k, v in fields.items() if v is not None}
    engine_max = 1 if max_tokens == 0 else max_tokens
    try:
        params = SamplingParams(max_tokens=engine_max, logprobs=logprobs, **given)
    except ValueError as exc:
        raise invalid(str(exc), _param_named_in(str(exc))) from None
    stream = bool(req.stream)
    options = req.stream_options or StreamOptions()
    include_usage = stream and bool(options.include_usage)
    return PreparedRequest(
        kind,
        ids,
        params,
        stream,
        include_usage,
        logprobs is not None,
        skip_special_tokens=req.skip_special_tokens is not False,
        continuous_usage=include_usage and bool(options.continuous_usage_stats),
        generates=generates,
        prompt=prompt,
    )


def _prompt_logprobs(asked: int | None, logprobs: int | None, echo: bool) -> int | None:
    """Top entries per prompt position the node computes: the `prompt_logprobs` field's, and
    an echo with `logprobs` shows the prompt tokens with as many as the generated ones."""
    wanted = [k for k in (asked, logprobs if echo else None) if k is not None]
    return max(wanted) if wanted else None


def _structured(req: _GenerationFields) -> dict[str, Any] | None:
    """The grammar spec of `response_format`, checked now so a bad schema is a 400 here."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None or not isinstance(fmt.json_schema.json_schema, dict):
        raise invalid(
            "response_format json_schema needs json_schema.schema (an object)", "response_format"
        )
    spec = {"type": "json_schema", "schema": json.dumps(fmt.json_schema.json_schema)}
    try:
        check_structured(spec)
    except ValueError as exc:
        raise invalid(str(exc), "response_format") from None
    return spec


def _logit_bias(bias: dict[str, float] | None) -> list[tuple[int, float]] | None:
    if not bias:
        return None
    try:
        return [(int(token), value) for token, value in bias.items()]
    except ValueError:
        raise invalid("logit_bias keys must be token ids", "logit_bias") from None


def _param_named_in(message: str) -> str | None:
    """SamplingParams errors start with the field name ("top_p must be ...")."""
    name = message.split(" ", 1)[0]
    if name == "structured":
        return "response_format"
    return name if name.isidentifier() else None
