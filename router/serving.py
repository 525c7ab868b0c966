"""The two generation endpoints: parse, validate, route, dispatch, then answer whole or as SSE.

Errors before dispatch are plain HTTP errors (400/404/503). Once a request is dispatched its
`Session` is closed exactly once however the response ends (finished, node error, timeout,
client gone), which aborts it on the nodes unless one of them finished it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from common.protocol.structured import load_xgrammar, xgrammar_loaded
from router.core import RouterCore
from router.errors import OpenAIError, error_body, from_validation_errors
from router.formatting import SSE_DONE, ResponseFormatter, sse
from router.prepare import apply_limits, check_model, prepare_chat, prepare_completion
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.session import Delta, Session, merge_delta
from router.timing import TimingMarks
from router.tools import ToolShaper, pick_parser

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SessionStream(StreamingResponse):
    """Closes its body generator and its session however the response ends: Starlette leaves
    a generator suspended at `yield` when the client disconnects between chunks, and a
    generator that never started runs no `finally` at all."""

    def __init__(self, content: AsyncIterator[str], session: Session) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.session = session

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            pass
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.session.close()


class GenerationHandler:
    def __init__(self, core: RouterCore, tokenizer: Any, model_names: list[str]) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.model_names = model_names  # the served name first, then accepted aliases
        self.tool_parser = pick_parser(core.config.tool_call_parser, tokenizer)

    async def __call__(self, kind: str, request: Request) -> Response:
        arrival = self.core.clock()
        try:
            session, formatter = await self._start(kind, request, arrival)
        except OpenAIError as exc:
            self.core.metrics.request_done(exc.status, None, 0)
            return exc.response()
        except Exception:
            log.exception("%s request failed before dispatch", kind)
            self.core.metrics.request_done(500, None, 0)
            return JSONResponse(error_body(500, "internal error"), status_code=500)
        if session.prepared.stream:
            return SessionStream(self._stream(session, formatter), session)
        return await self._complete(session, formatter, request)

    async def _start(
        self, kind: str, request: Request, arrival: float
    ) -> tuple[Session, ResponseFormatter]:
        body = await request.body()
        schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:
            parsed = schema.model_validate_json(body)
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_context=False)
            raise from_validation_errors(list(errors)) from None
        check_model(parsed.model, self.model_names)
        structured = parsed.response_format is not None or getattr(parsed, "tools", None)
        if structured and not xgrammar_loaded():
            await asyncio.to_thread(load_xgrammar)  # its first import takes seconds
        if isinstance(parsed, ChatCompletionRequest):
            prepared = prepare_chat(parsed, self.tokenizer, self.tool_parser)
        else:
            prepared = prepare_completion(parsed, self.tokenizer)
        route = self.core.route(prepared.prompt_token_ids)
        prepared = apply_limits(prepared, route.limits)
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        now = self.core.clock()
        marks = TimingMarks(arrival, dispatched=now)
        # The nodes drop the request on their own at the same deadline, should the router's
        # abort never reach them.
        deadline_s = max(0.0, arrival + self.core.config.request_timeout_s - now)
        queue = self.core.dispatch(request_id, prepared, route, deadline_s)
        marks.sent = self.core.clock()  # router_encode: messages encoded and handed off
        session = Session(self.core, request_id, prepared, route, queue, marks, self.tokenizer)
        formatter = ResponseFormatter(
            kind,
            request_id,
            self.model_names[0],
            int(time.time()),
            self.tokenizer,
            logprobs=prepared.return_logprobs,
            include_usage=prepared.include_usage,
            continuous_usage=prepared.continuous_usage,
            prompt=prepared.prompt,
        )
        return session, formatter

    async def _complete(
        self, session: Session, formatter: ResponseFormatter, request: Request
    ) -> Response:
        collect = asyncio.ensure_future(self._collect(session, formatter))
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await collect
            session.close()
        if collect.cancelled():
            return Response(status_code=499)
        return collect.result()

    async def _collect(self, session: Session, formatter: ResponseFormatter) -> Response:
        shaper = ToolShaper(session.prepared.tools)
        choices: dict[int, Delta] = {}
        try:
            async for delta in session.deltas():
                merge_delta(choices, shaper.shape(delta))
        except OpenAIError as exc:
            return exc.response()
        except Exception:
            log.exception("request %s failed", session.request_id)
            session.status = 500
            return JSONResponse(error_body(500, "internal error"), status_code=500)
        ordered = [choices[i] for i in sorted(choices)]
        timing = session.timing().to_dict()
        body = formatter.response(ordered, session.usage(), timing, session.prompt_logprobs)
        return JSONResponse(body)

    async def _stream(self, session: Session, formatter: ResponseFormatter) -> AsyncIterator[str]:
        shaper = ToolShaper(session.prepared.tools)
        try:
            async for delta in session.deltas():
                delta = shaper.shape(delta)
                timing = session.timing().to_dict() if delta.finish_reason else None
                chunk = formatter.chunk(delta, timing, session.usage(), session.prompt_logprobs)
                if chunk is not None:
                    yield sse(chunk)
            if formatter.include_usage:
                yield sse(formatter.usage_chunk(session.usage(), session.timing().to_dict()))
            yield SSE_DONE
        except OpenAIError as exc:
            yield sse(exc.body())
        except Exception:
            log.exception("request %s failed", session.request_id)
            session.status = 500
            yield sse(error_body(500, "internal error"))
        finally:
            session.close()


async def _client_gone(request: Request) -> None:
    """Returns once the client has disconnected (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
