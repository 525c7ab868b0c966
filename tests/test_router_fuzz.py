"""Schemathesis against the router's OpenAPI schema (a CI-sized, derandomized run): bodies
generated from the request schemas, valid and invalid, never get a 5xx and never break the
app. The router runs in-process against loopback nodes that answer every request."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from common.model.source import ModelSource
from common.text.tokenizer import load_tokenizer
from router.app import create_app
from router.config import RouterConfig
from tests.router_fakes import LoopbackNodes, ManualClock, generation_script, heartbeat

P, D = "tcp://127.0.0.1:5601", "tcp://127.0.0.1:5701"
OPERATIONS = [
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /tokenize",
    "POST /detokenize",
    "GET /v1/models",
    "GET /health",
    "GET /metrics",
    "GET /version",
]


@pytest.fixture(scope="module")
def router_schema(smollm_dir):
    source = ModelSource(smollm_dir, "SmolLM2-135M-Instruct")
    link = LoopbackNodes(generation_script([42, 43, 44]))
    config = RouterConfig(prefill=(P,), decode=(D,), served_model_name="smol")
    app = create_app(
        config, source=source, tokenizer=load_tokenizer(smollm_dir), link=link, clock=ManualClock()
    )
    link.deliver = app.state.core.on_message
    app.state.core.on_message(heartbeat(P, "prefill"))
    app.state.core.on_message(heartbeat(D, "decode"))
    return schemathesis.openapi.from_asgi("/openapi.json", app)


CASES = [(label, GenerationMode.POSITIVE) for label in OPERATIONS] + [
    (label, GenerationMode.NEGATIVE)
    for label in OPERATIONS[:2]  # only these take input
]


@pytest.mark.parametrize("label, mode", CASES, ids=[f"{op}-{m.value}" for op, m in CASES])
def test_no_generated_request_gets_a_server_error(router_schema, label, mode):
    operation = router_schema.find_operation_by_label(label)
    assert operation is not None, f"{label} is missing from /openapi.json"

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    def fuzz(case) -> None:
        if isinstance(case.body, dict) and case.body.get("n") is not None:
            case.body["n"] = 1  # the loopback nodes answer one sample
        case.call_and_validate(checks=[not_a_server_error])

    fuzz()


def test_the_schema_documents_every_request_body(router_schema):
    labels = [result.ok().label for result in router_schema.get_all_operations()]
    assert sorted(labels) == sorted(OPERATIONS)
    paths = router_schema.raw_schema["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].startswith("#/components/schemas/")
