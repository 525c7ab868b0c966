"""What the HTTP front door enforces before a request reaches an endpoint: the API key, the
body size limit, the body's media type and CORS. Plain ASGI middleware, so streamed responses
pass through untouched.

- `--api-key` (or PDSERVE_API_KEY): `/v1/*`, `/tokenize` and `/detokenize` need
  `Authorization: Bearer KEY`, else a 401 in the OpenAI error shape; `/health`, `/metrics` and
  `/version` stay open unless `--auth-all-endpoints`.
  CORS preflights (OPTIONS) carry no credentials by design and are answered by the CORS layer
  outside this one.
- `--max-request-body-bytes`: a larger body is a 413, whether it announces its length or not.
  The body is read here (up to the limit) and replayed to the endpoint.
- A body sent as another media type than JSON (`Content-Type` given, not `application/json` or
  `*/*+json`) is a 415, as `/openapi.json` declares; a body without `Content-Type` is read as
  JSON.
- `--allowed-origins` etc.: Starlette's CORSMiddleware, off when no origin is allowed.
"""

from __future__ import annotations

import hmac
import json

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.config import RouterConfig
from router.errors import error_body

PROTECTED = ("/v1/", "/tokenize", "/detokenize")  # the rest (/health, /metrics, /version) is open
BODY_METHODS = ("POST", "PUT", "PATCH")


async def _send_error(send: Send, status: int, message: str, code: str | None, **headers: str):
    body = json.dumps(error_body(status, message, code=code)).encode()
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, protect_all: bool) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.protect_all = protect_all

    def _protected(self, scope: Scope) -> bool:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            return False
        return self.protect_all or scope.get("path", "").startswith(PROTECTED)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._protected(scope):
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            scheme, _, key = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.expected):
                what = "Missing" if not given else "Incorrect"
                await _send_error(
                    send, 401, f"{what} API key: send 'Authorization: Bearer <key>'.",
                    "invalid_api_key", **{"WWW-Authenticate": "Bearer"},
                )  # fmt: skip
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large(send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, send: Send) -> None:
        await _send_error(
            send, 413, f"request body exceeds {self.limit} bytes", "request_too_large"
        )


class JsonBodyMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") in BODY_METHODS:
            given = dict(scope.get("headers") or ()).get(b"content-type")
            media = (given or b"").split(b";", 1)[0].strip().lower()
            if given is not None and media != b"application/json" and not media.endswith(b"+json"):
                message = f"Content-Type must be application/json, got {given.decode('latin-1')!r}"
                await _send_error(send, 415, message, "unsupported_media_type")
                return
        await self.app(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The buffered body first, then whatever the client sends next (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def install(app: FastAPI, config: RouterConfig) -> None:
    """Add the layers, innermost first: media type, body limit, API key, then CORS outermost
    (so that a preflight, which carries no key, is answered, and errors carry CORS headers)."""
    app.add_middleware(JsonBodyMiddleware)
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_body_bytes)
    if config.api_key:
        app.add_middleware(
            ApiKeyMiddleware, api_key=config.api_key, protect_all=config.auth_all_endpoints
        )
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
            allow_credentials=config.allow_credentials,
        )
