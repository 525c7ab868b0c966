"""`/openapi.json` as the router serves it: request bodies, every status an endpoint answers and
its body, and the API key where one is required.

The endpoints read and validate their bodies themselves (`router/serving.py`: strict pydantic
models, OpenAI-shaped 400s), so FastAPI cannot see the body models; this adds them, rendered
from the same models that validate, so the document states the constraints the router
enforces. Errors are declared with the OpenAI error body (`router.errors.ErrorResponse`).
`tests/test_openapi_served.py` runs schemathesis with every check against a real stack.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from router.config import RouterConfig
from router.errors import ErrorResponse
from router.gateway import PROTECTED
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
REF = "#/components/schemas/{model}"
GENERATION = ("/v1/chat/completions", "/v1/completions")
ERRORS = {
    400: "Invalid request: the body, a value or a combination of fields (the message names it)",
    401: "Missing or wrong API key",
    404: "The model is not served",
    413: "The body exceeds --max-request-body-bytes",
    415: "The body is sent as another media type than JSON",
    429: "Too many requests waiting for a node; retry after Retry-After seconds",
    500: "Internal error",
    503: "No healthy prefill/decode path, or a node failed",
    504: "The request did not finish within --request-timeout-s",
}
# Which errors each path answers, besides 401 (API key) and 500 (any).
PATH_ERRORS = {
    "/v1/chat/completions": (400, 404, 413, 415, 429, 503, 504),
    "/v1/completions": (400, 404, 413, 415, 429, 503, 504),
    "/tokenize": (400, 404, 413, 415),
    "/detokenize": (400, 404, 413, 415),
}
# Before OpenAPI 3.2 the schema of an event stream is that of each event.
EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
STREAM = {"text/event-stream": {"schema": EVENT}}
METRICS = {"text/plain": {"schema": {"type": "string"}}}


class _Document(GenerateJsonSchema):
    """Pydantic's JSON Schema, plus what its validation enforces and its schema omits."""

    def dict_schema(self, schema: core_schema.DictSchema) -> JsonSchemaValue:
        out = super().dict_schema(schema)
        if "patternProperties" in out:  # keys that match no pattern are refused
            out["additionalProperties"] = False
        return out


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _error(status: int, error_ref: dict[str, Any]) -> dict[str, Any]:
    response: dict[str, Any] = {"description": ERRORS[status], "content": _json(error_ref)}
    if status == 429:
        response["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
    if status == 401:
        response["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    return response


def _document(app: FastAPI, config: RouterConfig) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})

    def component(model: type[BaseModel]) -> dict[str, Any]:
        body = model.model_json_schema(ref_template=REF, schema_generator=_Document)
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        return {"$ref": REF.format(model=model.__name__)}

    error_ref = component(ErrorResponse)
    for path, model in BODIES.items():
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": _json(component(model)),
        }
    for path in GENERATION:
        ok = schema["paths"][path]["post"]["responses"]["200"]
        ok["description"] = "The completion, or its chunks as server-sent events (stream: true)"
        ok["content"] = {**_json({"type": "object"}), **STREAM}
    schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = METRICS
    health = schema["paths"]["/health"]["get"]["responses"]
    health["503"] = {"description": "No healthy path through the nodes", **health["200"]}

    if config.api_key:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            responses = operation["responses"]
            for status in (*PATH_ERRORS.get(path, ()), 500):
                responses[str(status)] = _error(status, error_ref)
            if config.api_key and (config.auth_all_endpoints or path.startswith(PROTECTED)):
                operation["security"] = [{"bearer": []}]
                responses["401"] = _error(401, error_ref)
    return schema


def install_openapi(app: FastAPI, config: RouterConfig) -> None:
    """Serve `_document` at /openapi.json (built once, on the first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _document(app, config)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
