"""One streamed request to an OpenAI-compatible server, timed the way `vllm bench serve` does.

TTFT is the arrival of the first chunk that carries `choices`; every later such chunk adds an
inter-token gap (ITL); the request's latency (E2E) ends at the last such chunk. Output and
prompt token counts come from the final usage chunk (`stream_options.include_usage`), falling
back to the number of token chunks. A server that sends a `timing` field (ours) has it kept.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.workload.datasets import RequestSpec

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class Target:
    """Where and how requests are sent."""

    base_url: str
    model: str
    endpoint: str = "completions"
    ignore_eos: bool = True
    temperature: float | None = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.endpoint]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        """The request body, shaped as `vllm bench serve` shapes it (so a server that takes
        these takes vLLM's benchmark too): completions carry `repetition_penalty: 1.0` and
        `logprobs: null`, chat messages a list of text parts and `max_completion_tokens`."""
        out: dict[str, Any] = {"model": self.model}
        if self.endpoint == "chat":
            if spec.prompt is None:
                raise ValueError("the chat endpoint needs text prompts (use --text-prompts)")
            content = [{"type": "text", "text": spec.prompt}]
            out["messages"] = [{"role": "user", "content": content}]
            out["max_completion_tokens"] = spec.output_len
        else:
            prompt = spec.prompt_token_ids
            out["prompt"] = list(prompt) if prompt is not None else spec.prompt
            out["repetition_penalty"] = 1.0
            out["max_tokens"] = spec.output_len
            out["logprobs"] = None
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
        if self.temperature is not None:
            out["temperature"] = self.temperature
        if self.ignore_eos:
            out["ignore_eos"] = True
        out.update(self.extra_body)
        return out


@dataclass
class RequestResult:
    """What the client saw of one request. Times in seconds; `sent` and `scheduled` are
    offsets from the run's start, the others durations from `sent`."""

    index: int
    scheduled: float
    sent: float | None = None
    queue_wait: float = 0.0  # waiting for a --max-concurrency slot (not part of TTFT)
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    success: bool = False
    error: str | None = None
    status: int | None = None
    timing: dict[str, Any] | None = None  # the server's timing record (pdserve)

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None with fewer than two tokens."""
        if not self.success or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "scheduled": self.scheduled,
            "sent": self.sent,
            "queue_wait": self.queue_wait,
            "ttft": self.ttft,
            "tpot": self.tpot,
            "e2e": self.e2e,
            "itl": self.itl,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "success": self.success,
            "error": self.error,
            "status": self.status,
            "timing": self.timing,
        }

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> RequestResult:
        return cls(**{k: v for k, v in row.items() if k != "tpot"})


async def send(
    client: httpx.AsyncClient,
    target: Target,
    spec: RequestSpec,
    result: RequestResult,
    on_first_token: Callable[[RequestResult], None] | None = None,
) -> RequestResult:
    """Send one streamed request and fill `result` (never raises for a failed request)."""
    start = time.perf_counter()
    last = start
    buffer = b""
    try:
        body = target.body(spec)
        async with client.stream("POST", target.url, json=body, headers=target.headers()) as r:
            result.status = r.status_code
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                result.error = f"HTTP {r.status_code}: {_error_message(text)}"
                return result
            async for data in r.aiter_bytes():
                now = time.perf_counter()
                buffer += data
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    if _handle_event(event, result, now - start, last - start):
                        if result.ttft is None:
                            result.ttft = now - start
                            if on_first_token is not None:
                                on_first_token(result)
                        last = now
        if result.ttft is None:
            result.error = result.error or "the stream ended without a token chunk"
            return result
        result.e2e = last - start
        result.success = result.error is None
        if not result.output_tokens:
            result.output_tokens = len(result.itl) + 1
        return result
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result


def _handle_event(event: bytes, result: RequestResult, now: float, last: float) -> bool:
    """Parse one SSE event; True when it is a token chunk (carries `choices`)."""
    line = event.strip()
    if not line.startswith(b"data:"):
        return False  # an SSE comment or keep-alive
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return False
    chunk = json.loads(payload)
    if "error" in chunk:
        result.error = f"stream error: {_error_message(json.dumps(chunk))}"
        return False
    if chunk.get("timing"):
        result.timing = chunk["timing"]
    usage = chunk.get("usage")
    if usage:
        result.output_tokens = int(usage.get("completion_tokens") or 0)
        result.prompt_tokens = usage.get("prompt_tokens")
    if not chunk.get("choices"):
        return False
    if result.ttft is not None:
        result.itl.append(now - last)
    return True


def _error_message(text: str) -> str:
    try:
        body = json.loads(text)
        return str(body["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return text[:300]
