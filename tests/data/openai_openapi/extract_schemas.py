"""Write `responses.json`: the response schemas of OpenAI's OpenAPI document, self-contained.

    python tests/data/openai_openapi/extract_schemas.py OPENAPI_JSON [--commit SHA]

OPENAPI_JSON is `openapi.json` of a checkout of github.com/openai/openai-openapi (MIT). Each
schema in `KEPT` has its `$ref`s inlined, OpenAPI 3.0's `nullable: true` rewritten as JSON
Schema's `anyOf [..., {"type": "null"}]` (the document mixes both spellings) and its prose
(`description`, `x-*`, examples) dropped, so `jsonschema` (draft 2020-12) validates with it
alone. `CompletionStreamChunk` is derived: the document has no schema for a streamed text
completion, which OpenAI sends as `CreateCompletionResponse` objects whose `finish_reason` is
null until the last chunk and whose `usage` is null (stream_options.include_usage) but in the
usage chunk.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

KEPT = (
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "ErrorResponse",
)
OUT = Path(__file__).with_name("responses.json")
# Keywords whose value is one subschema, a list of them, or a map of name -> subschema.
ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
NAMED = ("properties", "patternProperties", "dependentSchemas")
PROSE = ("description", "example", "examples", "title", "deprecated")


def resolve(schema: Any, components: dict[str, Any], seen: tuple[str, ...] = ()) -> Any:
    """`schema` with refs inlined, nullable rewritten and prose dropped (walks keywords only:
    a property named `description` is kept)."""
    if not isinstance(schema, dict):
        return schema
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/components/schemas/")
        if name in seen:
            raise ValueError(f"recursive schema {' -> '.join((*seen, name))}: cannot inline it")
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        return resolve({**components[name], **rest}, components, (*seen, name))
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in PROSE or key.startswith("x-") or key == "nullable":
            continue
        if key in ONE:
            out[key] = resolve(value, components, seen)
        elif key in MANY:
            out[key] = [resolve(v, components, seen) for v in value]
        elif key in NAMED:
            out[key] = {name: resolve(v, components, seen) for name, v in value.items()}
        else:
            out[key] = value
    if schema.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


def completion_stream_chunk(response: dict[str, Any]) -> dict[str, Any]:
    chunk = copy.deepcopy(response)
    choice = chunk["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
    chunk["properties"]["usage"] = {"anyOf": [chunk["properties"]["usage"], {"type": "null"}]}
    return chunk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("openapi", type=Path, help="openapi.json of openai/openai-openapi")
    ap.add_argument("--commit", default="", help="the checkout's commit, recorded in the output")
    args = ap.parse_args()
    document = json.loads(args.openapi.read_text())
    components = document["components"]["schemas"]
    schemas = {name: resolve(components[name], components) for name in KEPT}
    schemas["CompletionStreamChunk"] = completion_stream_chunk(schemas["CreateCompletionResponse"])
    info = document["info"]
    out = {
        "source": {
            "repository": "https://github.com/openai/openai-openapi",
            "commit": args.commit,
            "title": info["title"],
            "version": info["version"],
            "license": info["license"]["name"],
        },
        "schemas": schemas,
    }
    OUT.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
