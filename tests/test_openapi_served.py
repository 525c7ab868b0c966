"""`/openapi.json` describes the API as served: schemathesis with every check (what
`schemathesis run URL -c all` runs: its coverage and fuzzing phases, valid and invalid bodies,
undeclared methods, status codes, content types, headers, response schemas) against a real
stack, the router with a colocated node on the embedded model, finds nothing. Derandomized and
with few examples per operation, so CI runs the same cases each time.

Before a valid body is sent, `within_deployment` bounds what the document cannot state (it
says so in `router/protocol.py`): token ids within this model's vocabulary, a short generation
(`max_tokens`, and `min_tokens` below it), a named `tool_choice` among the `tools`, tool-call
arguments, JSON Schemas and chat templates that parse, and `continue_final_message` only after
an assistant message. Invalid bodies are sent as generated.
"""

from __future__ import annotations

import json
from typing import Any

import jinja2
import pytest
import schemathesis
from schemathesis.engine import Status, events, from_schema
from schemathesis.generation import GenerationMode

from benchmarks.stack import same_python_env
from common.protocol.structured import check_structured
from tests.pd_stack import PDStack

VOCAB = 49152  # the embedded SmolLM2's vocabulary (and its tokenizer's length)
MAX_TOKENS = 2
GENERATION = ("/v1/chat/completions", "/v1/completions")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openapi")
    env = same_python_env(tmp / "venv")
    stack = PDStack(
        "--colocated",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        log_path=tmp / "launch.log",
        env=env,
    )
    yield stack
    assert stack.stop() == [], "processes left after Ctrl-C"


def _compiles(schema: Any) -> bool:
    try:
        check_structured({"type": "json_schema", "schema": json.dumps(schema)})
    except ValueError:
        return False
    return True


def _template_renders(template: str) -> bool:
    try:
        jinja2.Environment().from_string(template).render(messages=[])
    except Exception:
        return False
    return True


def _arguments(call: dict[str, Any]) -> None:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            function["arguments"] = "{}"


def _chat(body: dict[str, Any]) -> None:
    for message in body.get("messages") or ():
        for call in message.get("tool_calls") or ():
            _arguments(call)
    messages = body.get("messages") or [{}]
    if body.get("continue_final_message") and messages[-1].get("role") != "assistant":
        body["continue_final_message"] = False
    if isinstance(body.get("chat_template"), str) and not _template_renders(body["chat_template"]):
        del body["chat_template"]
    tools = body.get("tools") or []
    forced = body.get("tool_choice") not in (None, "none", "auto")
    for tool in tools:
        function = tool["function"]
        if forced and function.get("parameters") and not _compiles(function["parameters"]):
            function["parameters"] = None
    if isinstance(body.get("tool_choice"), dict) and tools:
        body["tool_choice"]["function"]["name"] = tools[0]["function"]["name"]


def _generation(body: dict[str, Any]) -> None:
    for field in ("max_tokens", "max_completion_tokens"):
        if body.get(field) is not None:
            body[field] = min(body[field], MAX_TOKENS)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
    limit = body.get("max_completion_tokens")  # chat: it wins over max_tokens
    limit = body.get("max_tokens") if limit is None else limit
    if body.get("min_tokens") is not None:
        body["min_tokens"] = min(body["min_tokens"], limit)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        body["prompt"] = [[t % VOCAB for t in prompt[0]]]
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        body["prompt"] = [t % VOCAB for t in prompt]
    if body.get("stop_token_ids"):
        body["stop_token_ids"] = [t % VOCAB for t in body["stop_token_ids"]]
    if body.get("logit_bias"):
        body["logit_bias"] = {str(int(k) % VOCAB): v for k, v in body["logit_bias"].items()}
    fmt = body.get("response_format") or {}
    spec = fmt.get("json_schema") if fmt.get("type") == "json_schema" else None
    if spec is not None and not _compiles(spec["schema"]):
        spec["schema"] = {"type": "object"}


def within_deployment(path: str, body: Any) -> None:
    """Bound a valid body, in place, to what this deployment serves (see the module doc)."""
    if not isinstance(body, dict):
        return
    if path in ("/v1/chat/completions", "/tokenize") and body.get("messages") is not None:
        _chat(body)
    if path in GENERATION:
        _generation(body)
    if path == "/detokenize":
        body["tokens"] = [t % VOCAB for t in body.get("tokens") or ()]


def failures(url: str) -> list[str]:
    """What `schemathesis run URL/openapi.json -c all` reports, one line per failure."""
    config = schemathesis.Config()
    project = config.projects.override
    project.checks.update(included_check_names=["all"])
    project.generation.update(max_examples=8, deterministic=True)
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=config)

    @schema.hook
    def before_call(context, case, kwargs) -> None:
        if case.meta is not None and case.meta.generation.mode == GenerationMode.POSITIVE:
            within_deployment(case.path, case.body)

    found = []
    for event in from_schema(schema).execute():
        if isinstance(event, (events.NonFatalError, events.FatalError)):
            found.append(f"error: {event.info.format()}" if hasattr(event, "info") else "error")
        if isinstance(event, events.ScenarioFinished):
            for checks in event.recorder.checks.values():
                for check in checks:
                    if check.status == Status.FAILURE and check.failure_info is not None:
                        info = check.failure_info
                        found.append(f"{event.label}: {info.failure.title}\n{info.code_sample}")
    return sorted(set(found))


def test_schemathesis_with_every_check_finds_nothing(stack):
    found = failures(stack.url)
    assert found == [], "\n\n".join(found)


def test_the_document_declares_the_errors_and_the_metrics_format(stack):
    import httpx

    document = httpx.get(stack.url + "/openapi.json").json()
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert {"400", "404", "413", "429", "500", "503", "504"} <= set(chat["responses"])
    error = chat["responses"]["400"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "Retry-After" in chat["responses"]["429"]["headers"]
    assert list(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == [
        "text/plain"
    ]
    body = document["components"]["schemas"]["ChatCompletionRequest"]
    assert body["properties"]["messages"]["minItems"] == 1
    assert body["required"] == ["messages"]
