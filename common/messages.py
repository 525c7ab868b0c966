"""Inter-process control messages: dataclasses, one msgpack codec, validation on receipt.

Every message is a frozen dataclass registered by name; `encode` writes
`{"type": name, **fields}` with msgpack (never pickle) and `decode` checks the type name and
every field's type before building the dataclass, so a malformed or hostile frame raises
`MessageError` instead of reaching node logic.

Who sends what (see docs/architecture.md for the full lifecycle):
  router  -> prefill  PrefillRequest, Abort
  router  -> decode   DecodeRequest, Abort
  decode  -> prefill  Reservation
  prefill -> router   FirstToken, RequestError, Heartbeat
  decode  -> router   TokenBatch, RequestError, Heartbeat
KV bytes and the transfer-complete notice travel through kv_transfer, not here.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import msgpack


class MessageError(ValueError):
    pass


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams fields
    decode_node: str  # control address of the decode node that reserved / will reserve blocks
    decode_kv_address: str  # where that decode node receives KV


@dataclass(frozen=True)
class DecodeRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    prefill_node: str | None  # control address of the prefill node; None = prefill locally


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Reservation:
    request_id: str
    decode_node: str
    block_ids: list[int]


@dataclass(frozen=True)
class FirstToken:
    request_id: str
    token_id: int
    logprob: float | None
    top_logprobs: list[list[float]] | None  # [[token_id, logprob], ...]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    timing: dict[str, float]  # durations in seconds measured by the prefill node


@dataclass(frozen=True)
class TokenOutput:
    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[list[float]]] | None
    finished: bool
    finish_reason: str | None
    timing: dict[str, float] | None  # decode-side durations, sent with the first and last output


@dataclass(frozen=True)
class TokenBatch:
    outputs: list[dict[str, Any]]  # TokenOutput fields, one per request that advanced this step

    def items(self) -> list[TokenOutput]:
        return [from_fields(TokenOutput, o) for o in self.outputs]


@dataclass(frozen=True)
class RequestError:
    request_id: str
    message: str
    status: int = 500  # HTTP status the router should answer with


@dataclass(frozen=True)
class Heartbeat:
    node_id: str  # the node's control address
    role: str  # "prefill" | "decode" | "colocated"
    info: dict[str, Any]  # static: model name, max_model_len, vocab_size, kv_address, ...
    load: dict[str, Any] = field(default_factory=dict)  # free blocks, running, queued tokens


MESSAGES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        PrefillRequest,
        DecodeRequest,
        Abort,
        Reservation,
        FirstToken,
        TokenBatch,
        RequestError,
        Heartbeat,
    )
}
Message = typing.Union[tuple(MESSAGES.values())]  # noqa: UP007


def encode(message: Any) -> bytes:
    name = type(message).__name__
    if name not in MESSAGES:
        raise MessageError(f"not a registered message: {name}")
    return msgpack.packb({"type": name, **dataclasses.asdict(message)}, use_bin_type=True)


def decode(frame: bytes) -> Any:
    try:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MessageError(f"undecodable frame: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise MessageError("frame is not a typed message")
    cls = MESSAGES.get(raw.pop("type"))
    if cls is None:
        raise MessageError("unknown message type")
    return from_fields(cls, raw)


def from_fields(cls: type, raw: dict[str, Any]) -> Any:
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(raw) - names
    if unknown:
        raise MessageError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise MessageError(f"{cls.__name__}: missing field {f.name!r}")
            continue
        if not _matches(raw[f.name], hints[f.name]):
            raise MessageError(f"{cls.__name__}.{f.name}: wrong type {type(raw[f.name]).__name__}")
    return cls(**raw)


_HINT_CACHE: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINT_CACHE:
        _HINT_CACHE[cls] = typing.get_type_hints(cls)
    return _HINT_CACHE[cls]


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if origin is dict:
        key, val = typing.get_args(hint)
        return isinstance(value, dict) and all(
            _matches(k, key) and _matches(v, val) for k, v in value.items()
        )
    return isinstance(value, hint)
