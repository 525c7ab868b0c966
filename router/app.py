"""`create_app(config)`: the FastAPI application of the router.

Every error leaves as OpenAI-shaped JSON; nothing a request does can stop the server. The ZMQ
sockets are opened at startup unless a `link` is injected (tests); then the caller feeds events
through `app.state.core.on_message` and sweeps liveness itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.model.source import ModelSource, resolve_model
from common.text.tokenizer import load_tokenizer
from router import gateway
from router.config import RouterConfig
from router.core import RouterCore
from router.errors import OpenAIError, error_body, from_validation_errors
from router.metrics import CONTENT_TYPE, RouterMetrics
from router.node_link import NodeLink, ZmqNodeLink
from router.openapi import install_openapi
from router.serving import GenerationHandler
from router.stats import log_stats_forever
from router.tokens import add_token_routes

log = logging.getLogger(__name__)


def create_app(
    config: RouterConfig,
    *,
    source: ModelSource | None = None,
    tokenizer: Any = None,
    link: NodeLink | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> FastAPI:
    """`source` / `tokenizer` default to `resolve_model(config.model)` and its tokenizer."""
    source = source or resolve_model(config.model)
    if tokenizer is None:
        tokenizer = load_tokenizer(source.directory)
    served = config.served_model_name or source.name
    names = [served, *sorted({source.name, config.model or source.name} - {served})]
    core = RouterCore(config, RouterMetrics(served), link=link, clock=clock)
    handler = GenerationHandler(core, tokenizer, names)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned: ZmqNodeLink | None = None
        tasks: list[asyncio.Task[None]] = []
        if core.link is None:
            owned = ZmqNodeLink(config.events_address, [*config.prefill, *config.decode])
            core.link = owned
            tasks = [
                asyncio.create_task(owned.run(core.on_message, core.events_read)),
                asyncio.create_task(core.sweep_forever()),
            ]
            log.info("router listening for node events on %s", config.events_address)
            if config.stats_interval > 0:
                tasks.append(asyncio.create_task(log_stats_forever(core, config.stats_interval)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if owned is not None:
                core.link = None
                owned.close()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.core = core
    gateway.install(app, config)
    install_openapi(app, config)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_errors(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's 405 carries `Allow` (RFC 9110 requires it): keep the exception's headers.
        body = error_body(exc.status_code, str(exc.detail))
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return JSONResponse(error_body(500, "internal error"), status_code=500)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handler("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handler("completion", request)

    def max_model_len() -> int | None:
        lens = [n.info["max_model_len"] for n in core.registry.nodes.values() if n.alive]
        return min(lens) if lens else None

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": served,
            "object": "model",
            "created": created,
            "owned_by": "pdserve",
            # A path AutoTokenizer loads from (what `vllm bench serve --tokenizer` needs).
            "root": str(source.directory),
            "parent": None,
            "max_model_len": max_model_len(),
        }
        return {"object": "list", "data": [card]}

    add_token_routes(app, tokenizer, names, max_model_len)

    @app.get("/health")
    async def health() -> JSONResponse:
        now = core.liveness_now()
        ok = core.link is not None and core.registry.has_path(now)
        body = {
            "status": "ok" if ok else "unavailable",
            "mode": "colocated" if config.colocated else "pd",
            "nodes": core.registry.report(now),
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        core.refresh_gauges()
        return PlainTextResponse(core.metrics.render(), media_type=CONTENT_TYPE)

    return app
