"""`/openapi.json` describes the API as served: schemathesis with every check (what
`schemathesis run URL -c all` runs: its coverage and fuzzing phases, valid and invalid bodies,
undeclared methods, status codes, content types, headers, response schemas) against a real
stack, the router with a colocated node on the embedded model, finds nothing. Derandomized and
with few examples per operation, so CI runs the same cases each time.

Before a valid body is sent, `within_deployment` bounds what the document cannot state (it
says so in `router/protocol.py`): token ids within this model's vocabulary, a short generation
(`max_tokens` 1, `min_tokens` below it, `n` up to 2), a named `tool_choice` among the `tools`,
tool-call arguments, JSON Schemas and chat templates that parse, and `continue_final_message`
only after an assistant message. Invalid bodies are sent as generated.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import jinja2
import pytest
import schemathesis
from fastapi.testclient import TestClient
from schemathesis.engine import Status, events, from_schema
from schemathesis.generation import GenerationMode

from benchmarks.stack import same_python_env
from common.protocol.structured import check_structured
from router.app import create_app
from router.config import RouterConfig
from tests.pd_stack import PDStack
from tests.router_fakes import LoopbackNodes

VOCAB = 49152  # the embedded SmolLM2's vocabulary (and its tokenizer's length)
MAX_TOKENS = 1
MAX_N = 2  # n > 1 is exercised; 16 samples would only cost time
GENERATION = ("/v1/chat/completions", "/v1/completions")
P, D = "tcp://127.0.0.1:5601", "tcp://127.0.0.1:5701"


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


def _template_renders(template: str, messages: list[dict[str, Any]]) -> bool:
    """Renders, and to some text: an empty prompt is a 400."""
    try:
        return bool(jinja2.Environment().from_string(template).render(messages=messages))
    except Exception:
        return False


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
    if body.get("continue_final_message"):  # the template must render the message it continues
        body.pop("chat_template", None)
    template = body.get("chat_template")
    if isinstance(template, str) and not _template_renders(template, body["messages"]):
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
    for name in ("max_tokens", "max_completion_tokens"):
        if body.get(name) is not None:
            body[name] = min(body[name], MAX_TOKENS)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
    if body.get("n") is not None:
        body["n"] = min(body["n"], MAX_N)
    limit = body.get("max_completion_tokens")  # chat: it wins over max_tokens
    limit = body.get("max_tokens") if limit is None else limit
    if body.get("min_tokens") is not None:
        body["min_tokens"] = min(body["min_tokens"], limit)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        body["prompt"] = [[t % VOCAB for t in prompt[0]]]
    elif isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):  # ids, 2.0 too
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


@dataclass
class Run:
    failures: list[str] = field(default_factory=list)  # one entry per failed check or error
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)  # (operation, status)


def run_schemathesis(url: str) -> Run:
    """What `schemathesis run URL/openapi.json -c all` runs, deterministic and CI-sized."""
    config = schemathesis.Config()
    project = config.projects.override
    project.checks.update(included_check_names=["all"])
    project.generation.update(max_examples=8, deterministic=True)
    project.update(request_timeout=120)  # n = 16 on a busy CPU takes seconds, not a hang
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=config)

    @schema.hook
    def map_case(context, case):
        if case.meta is not None and case.meta.generation.mode == GenerationMode.POSITIVE:
            within_deployment(case.path, case.body)
        return case

    run = Run()
    for event in from_schema(schema).execute():
        if isinstance(event, events.NonFatalError):
            run.failures.append(f"error: {event.info.format()}")
        elif isinstance(event, events.FatalError):
            run.failures.append(f"fatal: {event.exception!r}")
        elif isinstance(event, events.ScenarioFinished):
            for interaction in event.recorder.interactions.values():
                if interaction.response is not None:
                    run.statuses[event.label, interaction.response.status_code] += 1
            for checks in event.recorder.checks.values():
                for check in checks:
                    if check.status == Status.FAILURE and check.failure_info is not None:
                        info = check.failure_info
                        run.failures.append(
                            f"{event.label}: {info.failure.title}\n{info.code_sample}"
                        )
    return run


def test_schemathesis_with_every_check_finds_nothing(stack):
    run = run_schemathesis(stack.url)
    assert run.failures == [], "\n\n".join(sorted(set(run.failures)))
    # It ran: valid requests were served by the node, invalid ones refused.
    for operation in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert run.statuses[operation, 200] >= 5 and run.statuses[operation, 400] >= 20
        assert run.statuses[operation, 405] >= 1 and run.statuses[operation, 415] >= 1


def test_a_wrong_method_is_a_405_naming_the_allowed_ones(stack):
    response = httpx.request("DELETE", stack.url + "/v1/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["message"] == "Method Not Allowed"


def test_the_document_declares_the_errors_and_the_metrics_format(stack):
    document = httpx.get(stack.url + "/openapi.json").json()
    chat = document["paths"]["/v1/chat/completions"]["post"]
    declared = {"200", "400", "404", "413", "415", "429", "500", "503", "504"}
    assert set(chat["responses"]) == declared
    error = chat["responses"]["400"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "Retry-After" in chat["responses"]["429"]["headers"]
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    body = document["components"]["schemas"]["ChatCompletionRequest"]
    assert body["properties"]["messages"]["minItems"] == 1 and body["required"] == ["messages"]
    assert "security" not in chat  # no --api-key


def test_with_an_api_key_the_document_declares_it_and_the_401(source, tokenizer):
    config = RouterConfig(prefill=(P,), decode=(D,), api_key="sk-test")
    app = create_app(config, source=source, tokenizer=tokenizer, link=LoopbackNodes())
    document = app.openapi()
    assert document["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"}
    }
    paths = document["paths"]
    for path, method in [("/v1/completions", "post"), ("/v1/models", "get"), ("/tokenize", "post")]:
        assert paths[path][method]["security"] == [{"bearer": []}]
        assert "WWW-Authenticate" in paths[path][method]["responses"]["401"]["headers"]
    assert "security" not in paths["/health"]["get"]  # open unless --auth-all-endpoints


@pytest.mark.parametrize("media", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_body_sent_as_another_media_type_than_json_is_a_415(source, tokenizer, media):
    config = RouterConfig(prefill=(P,), decode=(D,))
    app = create_app(config, source=source, tokenizer=tokenizer, link=LoopbackNodes())
    with TestClient(app) as client:
        body = json.dumps({"prompt": "hi", "max_tokens": 1})
        response = client.post("/v1/completions", content=body, headers={"content-type": media})
    assert response.status_code == 415 and media in response.json()["error"]["message"]
