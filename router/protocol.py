"""OpenAI request schemas: strict types (a string where a number belongs is a 400, not a guess)
carrying the ranges the router enforces, so `/openapi.json` (`router/openapi.py`) states what
is accepted and validation and document cannot drift apart.

No field is silently ignored: an unknown field is a 400 that names it (`extra="forbid"`); a
known field pdserve does not implement accepts only its neutral value (`null`, `false`, 1, ...)
and is refused otherwise with a 400 that says why (`_unsupported`). Fields are optional where
OpenAI allows `null`; defaults are applied in `router.prepare`. Rules across fields are checked
where they were (`router.prepare`, `router.chat`, `router.tools`) and stated in the document
as `if`/`then` (`_RULES`). The document cannot state what depends on the nodes or on compiling
text: prompt and `max_tokens` within the context, token ids within the vocabulary,
`min_tokens <= max_tokens`, a named `tool_choice` among `tools`, and JSON Schemas, chat
templates and tool-call arguments that parse; those are 400s too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from common.protocol.sampling_params import INT32_MAX, MAX_LOGPROBS, MAX_N, SEED_RANGE


def _integral(value: Any) -> Any:
    """JSON Schema counts 2.0 as an integer, pydantic's strict int does not: this agrees with
    the document."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# BeforeValidator last: after the bounds, so that they still reach the JSON schema.
Integral = BeforeValidator(_integral)
Int = Annotated[int, Integral]
Int32 = Annotated[int, Field(ge=0, le=INT32_MAX), Integral]  # counts and ids travel as int32
Positive32 = Annotated[int, Field(ge=1, le=INT32_MAX), Integral]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), Integral]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
NonEmpty = Annotated[str, Field(min_length=1)]
TokenKey = Annotated[str, StringConstraints(pattern=r"^[0-9]+$")]  # a token id as a JSON key


_REFUSED = object()


def _unsupported(hint: str) -> WrapValidator:
    """Refuses a value outside the field's type (its neutral values) with `hint`, not pydantic's
    generic message; the document shows the type."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            accepted = handler(value)
        except ValidationError:
            accepted = _REFUSED
        # A Literal takes 0 for false and true for 1; JSON Schema's const does not.
        if accepted is _REFUSED or (type(value) is bool) != (type(accepted) is bool):
            raise PydanticCustomError(
                "unsupported", "not supported by pdserve: {hint}", {"hint": hint}
            )
        return accepted

    return WrapValidator(check)


def _if_then(condition: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    return {"if": condition, "then": then}


def _field_is(name: str, value: dict[str, Any]) -> dict[str, Any]:
    return {"properties": {name: value}, "required": [name]}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM: with include_usage, usage in every chunk


class FunctionCall(_Strict):
    name: str
    # A JSON object, or its text (then it must parse as one: a 400 otherwise).
    arguments: str | dict[str, Any] = Field(
        "{}", json_schema_extra={"contentMediaType": "application/json"}
    )


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    # Only assistant messages carry tool_calls.
    model_config = ConfigDict(
        json_schema_extra=_if_then(
            _field_is("tool_calls", {"type": "array", "minItems": 1}),
            _field_is("role", {"const": "assistant"}),
        )
    )

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages
    reasoning_content: str | None = None  # assistant messages of reasoning models (Qwen3)
    refusal: str | None = None  # OpenAI echoes it back in assistant messages; not rendered


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema (a grammar when the call is forced)
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(_Strict):
    name: str | None = None
    description: str | None = None
    # A JSON Schema the output will follow. `schema` shadows a BaseModel attribute, hence
    # the alias.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


class _GenerationFields(_Strict):
    """Fields shared by chat and text completions, OpenAI's and the vLLM-style extensions."""

    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Positive32 | None = None
    temperature: Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX), Integral] | None = None  # -1 and 0: off
    min_p: Fraction | None = None
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1]), Integral] | None = None
    stop: NonEmpty | list[NonEmpty] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N), Integral] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    logit_bias: (
        dict[TokenKey, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None
    ) = None
    ignore_eos: bool | None = None
    min_tokens: Int32 | None = None
    stop_token_ids: list[Int32] | None = None
    response_format: ResponseFormat | None = None
    skip_special_tokens: bool | None = None
    # vLLM: per prompt token, its logprob and the top k
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # Accepted, never change the output.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    priority: Int | None = None
    # Known, not implemented: only the neutral value.
    best_of: Annotated[Literal[1] | None, _unsupported("one candidate per choice")] = None
    use_beam_search: Annotated[Literal[False] | None, _unsupported("no beam search")] = None
    length_penalty: Annotated[
        Literal[1.0] | None, _unsupported("length_penalty needs beam search")
    ] = None
    include_stop_str_in_output: Annotated[
        Literal[False] | None, _unsupported("stop strings are never included in the output")
    ] = None
    spaces_between_special_tokens: Annotated[
        Literal[True] | None, _unsupported("it must be true")
    ] = None
    truncate_prompt_tokens: Annotated[
        None, _unsupported("prompts are never truncated; shorten the prompt")
    ] = None
    guided_json: Annotated[None, _unsupported("use response_format json_schema")] = None
    guided_regex: Annotated[None, _unsupported("regex constraints are not supported")] = None
    guided_choice: Annotated[None, _unsupported("use response_format json_schema with an enum")] = (
        None
    )
    guided_grammar: Annotated[None, _unsupported("grammar constraints are not supported")] = None
    structured_outputs: Annotated[None, _unsupported("use response_format")] = None


# Continue the last message or open a new one, not both.
_CONTINUE_OR_OPEN = _if_then(
    _field_is("continue_final_message", {"const": True}),
    {"properties": {"add_generation_prompt": {"enum": [False, None]}}},
)
_TOOL_FORCED = _field_is("tool_choice", {"anyOf": [{"const": "required"}, {"type": "object"}]})
_RULES = [
    # top_logprobs needs logprobs
    _if_then(
        _field_is("top_logprobs", {"type": "integer"}), _field_is("logprobs", {"const": True})
    ),
    # a forced tool call needs tools, and is a grammar: no response_format beside it
    _if_then(_TOOL_FORCED, _field_is("tools", {"type": "array", "minItems": 1})),
    _if_then(
        _TOOL_FORCED,
        {
            "properties": {
                "response_format": {
                    "anyOf": [{"type": "null"}, _field_is("type", {"const": "text"})]
                }
            }
        },
    ),
    _CONTINUE_OR_OPEN,
]


class ChatCompletionRequest(_GenerationFields):
    model_config = ConfigDict(json_schema_extra={"allOf": _RULES})

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Positive32 | None = None
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM chat extensions
    chat_template: str | None = None  # a Jinja template that must render
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None  # needs an assistant message last
    add_special_tokens: bool | None = None
    documents: list[dict[str, Any]] | None = None
    # Known, not implemented
    functions: Annotated[None, _unsupported("use tools")] = None
    function_call: Annotated[None, _unsupported("use tool_choice")] = None
    modalities: Annotated[
        Annotated[list[Literal["text"]], Field(min_length=1, max_length=1)] | None,
        _unsupported("only text output is supported"),
    ] = None
    audio: Annotated[None, _unsupported("audio output is not supported")] = None
    prediction: Annotated[None, _unsupported("predicted outputs are not supported")] = None
    reasoning_effort: Annotated[
        None, _unsupported("use chat_template_kwargs (for Qwen3: enable_thinking)")
    ] = None
    web_search_options: Annotated[None, _unsupported("web search is not supported")] = None
    echo: Annotated[Literal[False] | None, _unsupported("echo is not supported")] = None
    mm_processor_kwargs: Annotated[None, _unsupported("multimodal inputs are not supported")] = None


class CompletionRequest(_GenerationFields):
    # One prompt per request: a text, token ids, or a list holding one of those.
    prompt: (
        NonEmpty
        | Annotated[list[Int32], Field(min_length=1)]
        | Annotated[list[NonEmpty], Field(min_length=1, max_length=1)]
        | Annotated[
            list[Annotated[list[Int32], Field(min_length=1)]], Field(min_length=1, max_length=1)
        ]
    )
    logprobs: Logprobs | None = None
    echo: bool | None = None  # the prompt before the completion (and its tokens in logprobs)
    # 0: nothing generated, only the echoed prompt or its logprobs (lm-eval's loglikelihood)
    max_tokens: Annotated[int, Field(ge=0, le=INT32_MAX), Integral] | None = None
    suffix: Annotated[Literal[""] | None, _unsupported("suffix (insertion) is not supported")] = (
        None
    )
    add_special_tokens: bool | None = None


class TokenizeRequest(_Strict):
    # Exactly one of prompt and messages; messages as a chat completion takes them.
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                _field_is("prompt", {"type": "string"}),
                _field_is("messages", {"type": "array"}),
            ],
            "allOf": [_CONTINUE_OR_OPEN],
        }
    )

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Int32]  # within the vocabulary
