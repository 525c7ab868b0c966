"""`/tokenize`, `/detokenize` and `/version`, in the shape vLLM serves them.

`/tokenize` takes a text `prompt` or chat `messages` (templated exactly as a chat completion
would be, tools included) and answers `{count, max_model_len, tokens, token_strs}`;
`/detokenize` takes `tokens` and answers `{prompt}`.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ValidationError

from router.chat import chat_prompt_ids, template_tools
from router.errors import from_validation_errors, invalid
from router.prepare import check_model
from router.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest


def version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0.0.0+source"


def add_token_routes(
    app: FastAPI,
    tokenizer: Any,
    model_names: list[str],
    max_model_len: Callable[[], int | None],
) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = _parse(TokenizeRequest, await request.body())
        check_model(req.model, model_names)
        if tokenizer is None:
            raise invalid("this model has no tokenizer")
        if (req.prompt is None) == (req.messages is None):
            raise invalid("give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            chat = ChatCompletionRequest.model_validate(
                req.model_dump(exclude={"prompt", "return_token_strs"}, exclude_none=True)
            )
            ids = chat_prompt_ids(chat, tokenizer, template_tools(chat.tools))
        else:
            add_special = req.add_special_tokens is not False
            ids = list(tokenizer.encode(req.prompt, add_special_tokens=add_special))
        strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": max_model_len(),
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = _parse(DetokenizeRequest, await request.body())
        check_model(req.model, model_names)
        if tokenizer is None:
            raise invalid("this model has no tokenizer")
        if any(not 0 <= t < len(tokenizer) for t in req.tokens):
            raise invalid(f"token ids must be in [0, {len(tokenizer)})", "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": version()}


def _parse(schema: type, body: bytes) -> Any:
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False)
        raise from_validation_errors(list(errors)) from None
