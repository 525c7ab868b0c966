"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error, as OpenAI's document defines it (`/openapi.json` shows it)."""

    error: ErrorDetail


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status) or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class OpenAIError(Exception):
    """A request-level failure: becomes one error response (or one SSE error event)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers: dict[str, str] = {}  # e.g. Retry-After on a 429

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def invalid(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def from_validation_errors(errors: list[dict[str, Any]]) -> OpenAIError:
    """Pydantic / FastAPI validation errors as one 400 naming the first offending field."""
    if not errors:
        return invalid("invalid request")
    extra = [e for e in errors if e.get("type") == "extra_forbidden"]
    if extra:
        loc = [str(p) for p in extra[0].get("loc", ()) if p != "body"]
        return invalid(
            f"unsupported field `{'.'.join(loc)}`: pdserve does not implement it (ignoring it "
            "could change the output)",
            param=loc[0] if loc else None,
        )
    parts = []
    for error in errors[:3]:
        loc = [str(p) for p in error.get("loc", ()) if p not in ("body",)]
        where = ".".join(loc)
        message = str(error.get("msg"))
        value = error.get("input")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            message += f", got {value!r}"  # a number out of range: name it
        parts.append(f"{where}: {message}" if where else message)
    first = [str(p) for p in errors[0].get("loc", ()) if p != "body"]
    return invalid("; ".join(parts), param=first[0] if first else None)
