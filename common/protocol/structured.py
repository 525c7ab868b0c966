"""Structured-output specs (`SamplingParams.structured`) checked without a tokenizer or torch:
the router refuses a bad one with a 400 before any node sees it, and a node checks it again
before compiling its grammar (`common/engine/logits_processors.py`). xgrammar, which parses the schema,
is imported on the first check only (it imports torch, which the router otherwise never needs).
"""

from __future__ import annotations

from typing import Any

STRUCTURED_TYPES = ("json_object", "json_schema")


_xgrammar: Any = None  # the module once its import finished


def load_xgrammar() -> Any:
    """The xgrammar module, imported on first use: seconds of CPU (it imports torch), which a
    router runs in a worker thread (`asyncio.to_thread`) rather than stall its event loop."""
    global _xgrammar
    if _xgrammar is None:
        import xgrammar

        _xgrammar = xgrammar
    return _xgrammar


def xgrammar_loaded() -> bool:
    """Whether `load_xgrammar` returns at once (no thread hop needed)."""
    return _xgrammar is not None


def check_structured(spec: dict[str, Any]) -> None:
    """ValueError (naming the problem) for a spec no grammar can be built from; no tokenizer."""
    xgr = load_xgrammar()

    kind = spec.get("type")
    if kind not in STRUCTURED_TYPES:
        raise ValueError(f"structured output type must be one of {STRUCTURED_TYPES}, got {kind!r}")
    if kind == "json_schema":
        schema = spec.get("schema")
        if not isinstance(schema, str):
            raise ValueError("a json_schema structured output needs its schema as JSON text")
        try:
            xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        except Exception as exc:  # xgrammar raises RuntimeError / InvalidJSONError
            raise ValueError(f"unsupported JSON schema: {_first_line(exc)}") from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split("] ", 1)[-1]  # drop xgrammar's "[time] file:line:" prefix
