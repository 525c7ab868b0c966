"""Inter-process control messages: dataclasses, one msgpack codec, validation on receipt.

Every message is a frozen dataclass registered by name; `encode` writes
`{"type": name, **fields}` with msgpack (never pickle) and `decode` checks the type name and
every field's type before building the dataclass, so a malformed or hostile frame raises
`MessageError` instead of reaching node logic. With a cluster secret set, frames are signed
(`common.protocol.wire_auth`) and an unsigned or forged one is a `MessageError` too.

`SamplingParams` fields travel as a map of its fields and are rebuilt on receipt with the same
per-field type checks, then its own value checks: the receiving node gets a validated
`SamplingParams` or a `MessageError`.

Integer arrays (prompt token ids, block ids, a step's sampled tokens) are `IntArray` fields:
1-D little-endian int32 numpy arrays that travel as one msgpack `bin` of their raw bytes
(`FloatArray`: float32, the same way). Encoding one is a memcpy and checking one on receipt is
O(1) Python (its byte length); the receiver checks value ranges vectorised where they matter
(`Worker.new_sequence`: the vocabulary). Received arrays are read-only views of the frame.
A nested message part (`PromptLogprobs`) travels as a map of its fields, arrays included.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NewType

import msgpack
import numpy as np

from common.protocol.sampling_params import SamplingParams
from common.protocol.wire_auth import SIGNER, SignatureError

INT_DTYPE = np.dtype("<i4")
FLOAT_DTYPE = np.dtype("<f4")
IntArray = NewType("IntArray", np.ndarray)  # 1-D little-endian int32; msgpack bin on the wire
FloatArray = NewType("FloatArray", np.ndarray)  # 1-D little-endian float32; msgpack bin
ARRAY_DTYPES: dict[Any, np.dtype] = {IntArray: INT_DTYPE, FloatArray: FLOAT_DTYPE}
FINISH_REASONS = frozenset({"stop", "length", "abort", "error"})
# A finishing row's speculative decoding counts (the engine's SpecStats.to_dict plus its
# per-position acceptances); every count a non-negative int.
SPEC_DECODE_COUNTS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
SPEC_DECODE_KEYS = frozenset({*SPEC_DECODE_COUNTS, "mean_accepted_length", "accepted_per_position"})


class MessageError(ValueError):
    pass


def int_array(values: Any) -> np.ndarray:
    """`values` (ints or an integer array) as a 1-D little-endian int32 array; no copy when it
    already is one. MessageError for anything else, including values outside int32."""
    if isinstance(values, np.ndarray) and values.dtype == INT_DTYPE and values.ndim == 1:
        return values
    try:
        array = np.asarray(values)
        if array.size == 0:
            return np.zeros(0, dtype=INT_DTYPE)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise TypeError(f"{array.ndim}-D {array.dtype}")
        if array.dtype != INT_DTYPE and (array.min() < -(2**31) or array.max() >= 2**31):
            raise OverflowError("value outside int32")
        return array.astype(INT_DTYPE, copy=False)
    except (TypeError, ValueError, OverflowError) as exc:
        raise MessageError(f"not a 1-D array of int32 values: {exc}") from None


def float_array(values: Any) -> np.ndarray:
    """`values` (numbers or a float array) as a 1-D little-endian float32 array; no copy when
    it already is one. MessageError for anything else."""
    if isinstance(values, np.ndarray) and values.dtype == FLOAT_DTYPE and values.ndim == 1:
        return values
    try:
        array = np.asarray(values, dtype=FLOAT_DTYPE)
    except (TypeError, ValueError) as exc:
        raise MessageError(f"not a 1-D array of float32 values: {exc}") from None
    if array.ndim != 1:
        raise MessageError(f"not a 1-D array of float32 values: {array.ndim}-D")
    return array


def _coerce_arrays(message: Any, *names: str) -> None:
    """Called by __post_init__: lists given by a local sender become IntArrays too, so every
    reader sees one type whether the message was built here or decoded."""
    for name in names:
        object.__setattr__(message, name, int_array(getattr(message, name)))


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: IntArray
    sampling: SamplingParams
    decode_node: str  # control address of the decode node that reserved / will reserve blocks
    decode_kv_address: str  # where that decode node receives KV
    deadline_s: float | None = None  # seconds left at dispatch; the node drops it after that

    def __post_init__(self) -> None:
        _coerce_arrays(self, "prompt_token_ids")


@dataclass(frozen=True)
class DecodeRequest:
    request_id: str
    prompt_token_ids: IntArray
    sampling: SamplingParams
    prefill_node: str | None  # control address of the prefill node; None = prefill locally
    deadline_s: float | None = None  # seconds left at dispatch; the node drops it after that

    def __post_init__(self) -> None:
        _coerce_arrays(self, "prompt_token_ids")


@dataclass(frozen=True)
class Abort:
    request_id: str
    index: int | None = None  # n > 1: end only this sample (decode node); None: the request


@dataclass(frozen=True)
class Reservation:
    request_id: str
    decode_node: str
    block_ids: IntArray

    def __post_init__(self) -> None:
        _coerce_arrays(self, "block_ids")


@dataclass(frozen=True)
class PromptLogprobs:
    """Prompt logprobs (vLLM's `prompt_logprobs`), compact: row i is prompt position i + 1
    (the first prompt token has none), its token's logprob under the model given the tokens
    before it, that token's rank (1: the most likely) and the `top_k` most likely tokens with
    their logprobs, most likely first (`top_ids` and `top_logprobs` hold rows x top_k)."""

    top_k: int
    logprobs: FloatArray
    ranks: IntArray
    top_ids: IntArray
    top_logprobs: FloatArray

    def __post_init__(self) -> None:
        _coerce_arrays(self, "ranks", "top_ids")
        for name in ("logprobs", "top_logprobs"):
            object.__setattr__(self, name, float_array(getattr(self, name)))
        rows, k = len(self.logprobs), self.top_k
        if k < 0 or len(self.ranks) != rows or len(self.top_ids) != len(self.top_logprobs):
            raise MessageError(
                f"PromptLogprobs: {rows} logprobs, {len(self.ranks)} ranks, top_k {k}"
            )
        if len(self.top_ids) != rows * k:
            raise MessageError(f"PromptLogprobs: {len(self.top_ids)} top ids for {rows} x {k}")

    @property
    def num_rows(self) -> int:
        return len(self.logprobs)

    @classmethod
    def join(cls, parts: list[PromptLogprobs], top_k: int) -> PromptLogprobs:
        """The rows of `parts`, in order (each one chunk of a prompt); none: zero rows."""

        def cat(name: str, dtype: np.dtype) -> np.ndarray:
            arrays = [getattr(p, name) for p in parts]
            return np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)

        return cls(
            top_k,
            cat("logprobs", FLOAT_DTYPE),
            cat("ranks", INT_DTYPE),
            cat("top_ids", INT_DTYPE),
            cat("top_logprobs", FLOAT_DTYPE),
        )


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
    prompt_logprobs: PromptLogprobs | None = None  # when the sampling params asked


@dataclass(slots=True)
class TokenOutput:
    """One request's share of a TokenBatch, as the router consumes it (not sent on its own)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[list[float]]] | None
    finished: bool
    finish_reason: str | None
    timing: dict[str, float] | None  # decode-side durations, sent with the first output
    index: int = 0  # the sample (choice) of an n > 1 request; `finished` is about this one
    spec_decode: dict[str, Any] | None = None  # this sample's counts, on its finishing output
    prompt_logprobs: PromptLogprobs | None = None  # the request's, with its first output


@dataclass(frozen=True)
class TokenBatch:
    """One decode step's new tokens, column-wise: row i is one token of `request_ids[i]`.

    A request may own several rows (in order). Checking a batch costs O(1) Python for the
    token ids and one C-speed pass over the ids and finish reasons.
    """

    request_ids: list[str]
    token_ids: IntArray
    finish_reasons: list[str | None]  # None: the request goes on; else one of FINISH_REASONS
    logprobs: list[float | None] | None = None  # per row; None when no row asked
    top_logprobs: list[list[list[float]] | None] | None = None  # per row: [[token, logprob]]
    timing: dict[str, dict[str, float]] = field(default_factory=dict)  # by request id
    # n > 1: the sample each row belongs to (its finish reason is that sample's); None: all 0
    indices: list[int] | None = None
    # Per row: a speculating sample's counts (`SPEC_DECODE_KEYS`), on its finishing row only;
    # None when no row carries any
    spec_decode: list[dict[str, Any] | None] | None = None
    # By request id, sent with its first row (colocated: the node prefilled the prompt)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _coerce_arrays(self, "token_ids")
        n = len(self.request_ids)
        lengths = {len(self.token_ids), len(self.finish_reasons)}
        for column in (self.logprobs, self.top_logprobs, self.indices, self.spec_decode):
            if column is not None:
                lengths.add(len(column))
        if lengths != {n}:
            raise MessageError(f"TokenBatch columns differ in length: {n} rows, {lengths}")
        if not set(self.finish_reasons) <= FINISH_REASONS | {None}:
            bad = set(self.finish_reasons) - FINISH_REASONS - {None}
            raise MessageError(f"TokenBatch: unknown finish reasons {sorted(map(str, bad))}")
        for i, counts in enumerate(self.spec_decode or ()):
            if counts is not None:
                if self.finish_reasons[i] is None:
                    raise MessageError(f"TokenBatch row {i}: spec_decode on a row that goes on")
                check_spec_decode(counts)

    def items(self) -> list[TokenOutput]:
        ids, reasons = self.token_ids.tolist(), self.finish_reasons
        lps = self.logprobs or [None] * len(ids)
        tops = self.top_logprobs or [None] * len(ids)
        indices = self.indices or [0] * len(ids)
        specs = self.spec_decode or [None] * len(ids)
        out, reported = [], set()
        for i, rid in enumerate(self.request_ids):
            timing = prompt = None
            if rid not in reported:  # the report goes with the request's first row only
                reported.add(rid)
                timing = self.timing.get(rid)
                prompt = self.prompt_logprobs.get(rid)
            out.append(
                TokenOutput(
                    rid,
                    [ids[i]],
                    None if lps[i] is None else [lps[i]],
                    None if tops[i] is None else [tops[i]],
                    reasons[i] is not None,
                    reasons[i],
                    timing,
                    indices[i],
                    specs[i],
                    prompt,
                )
            )
        return out


def check_spec_decode(counts: dict[str, Any]) -> None:
    """MessageError naming the offending values unless `counts` is one sample's consistent
    speculative decoding counts: non-negative ints, accepted <= drafted, and per position j
    at most one acceptance per draft, summing to the accepted tokens."""
    if set(counts) != SPEC_DECODE_KEYS:
        missing = sorted(SPEC_DECODE_KEYS - set(counts))
        unknown = sorted(map(str, set(counts) - SPEC_DECODE_KEYS))
        raise MessageError(f"spec_decode fields: missing {missing}, unknown {unknown}")
    per_position = counts["accepted_per_position"]
    values = [counts[k] for k in SPEC_DECODE_COUNTS]
    if type(per_position) is not list:
        raise MessageError(f"spec_decode accepted_per_position is not a list: {per_position!r}")
    for value in [*values, *per_position]:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise MessageError(f"spec_decode counts must be ints >= 0, got {counts}")
    drafts, drafted, accepted = values
    if accepted > drafted or drafted < drafts or (drafts == 0 and drafted > 0):
        raise MessageError(
            f"spec_decode: {accepted} accepted of {drafted} drafted tokens in {drafts} drafts"
        )
    if sum(per_position) != accepted or any(n > drafts for n in per_position):
        raise MessageError(
            f"spec_decode accepted_per_position {per_position} does not fit {accepted} "
            f"accepted tokens in {drafts} drafts"
        )
    mean = counts["mean_accepted_length"]
    if not isinstance(mean, (int, float)) or isinstance(mean, bool):
        raise MessageError(f"spec_decode mean_accepted_length is not a number: {mean!r}")


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
    """One frame: a map of the message's fields (shallow: no dataclasses.asdict deep copy);
    arrays go as the raw bytes of their buffer."""
    names = _field_names(type(message))
    body: dict[str, Any] = {"type": type(message).__name__}
    for name in names:
        body[name] = _wire(getattr(message, name))
    return SIGNER.sign(msgpack.packb(body, use_bin_type=True))


def _wire(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.data
    if isinstance(value, SamplingParams):
        return vars(value)  # flat: its lists and tuples pack as msgpack arrays
    if isinstance(value, PromptLogprobs):
        return {name: _wire(v) for name, v in vars(value).items()}
    if type(value) is dict and value and isinstance(next(iter(value.values())), PromptLogprobs):
        return {key: _wire(v) for key, v in value.items()}  # TokenBatch.prompt_logprobs
    return value


def decode(frame: bytes) -> Any:
    """The message in `frame`; MessageError (never anything else) for a bad signature (see
    common.protocol.wire_auth), undecodable bytes, an unknown type or a field of the wrong type."""
    try:
        frame = SIGNER.verify(frame)
    except SignatureError as exc:
        raise MessageError(str(exc)) from None
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
    """Build `cls` from a decoded map, checking every field against its type hint; an IntArray
    field takes a bytes value (its int32 buffer). MessageError for anything else."""
    checks, required = _checks(cls)
    unknown = raw.keys() - checks.keys()
    if unknown:
        raise MessageError(f"{cls.__name__}: unknown fields {sorted(map(str, unknown))}")
    missing = required - raw.keys()
    if missing:
        raise MessageError(f"{cls.__name__}: missing field {sorted(missing)[0]!r}")
    for name, value in raw.items():
        try:
            ok, converted = checks[name](value)
        except MessageError as exc:  # a nested message's field
            raise MessageError(f"{cls.__name__}.{name}: {exc}") from None
        if not ok:
            raise MessageError(f"{cls.__name__}.{name}: wrong type {type(value).__name__}")
        raw[name] = converted
    try:
        return cls(**raw)
    except ValueError as exc:  # MessageError included; SamplingParams' value checks raise it
        raise MessageError(f"{cls.__name__}: {exc}") from None


# -- per-class field checks, built once from the type hints ----------------------------------

Check = Callable[[Any], tuple[bool, Any]]
_CHECKS: dict[type, tuple[dict[str, Check], frozenset[str]]] = {}
_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _NAMES.get(cls)
    if names is None:
        if MESSAGES.get(cls.__name__) is not cls:
            raise MessageError(f"not a registered message: {cls.__name__}")
        names = _NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _checks(cls: type) -> tuple[dict[str, Check], frozenset[str]]:
    if cls not in _CHECKS:
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        required = frozenset(
            f.name
            for f in fields
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        _CHECKS[cls] = ({f.name: _check_for(hints[f.name]) for f in fields}, required)
    return _CHECKS[cls]


def _check_bytes_array(dtype: np.dtype) -> Check:
    def check(value: Any) -> tuple[bool, Any]:
        if not isinstance(value, bytes) or len(value) % dtype.itemsize:
            return False, value
        return True, np.frombuffer(value, dtype=dtype)

    return check


def _check_nested(cls: type) -> Check:
    """A dataclass carried as a map of its fields (SamplingParams)."""

    def check(value: Any) -> tuple[bool, Any]:
        if type(value) is not dict:
            return False, value
        return True, from_fields(cls, value)

    return check


def _check_for(hint: Any) -> Check:
    if hint in ARRAY_DTYPES:
        return _check_bytes_array(ARRAY_DTYPES[hint])
    if dataclasses.is_dataclass(hint):
        return _check_nested(hint)
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        if inner in ARRAY_DTYPES or dataclasses.is_dataclass(inner):
            check = _check_for(inner)
            return lambda value: (True, None) if value is None else check(value)
    if origin is dict and dataclasses.is_dataclass(args[1]):
        nested = _check_nested(args[1])

        def check_map(value: Any) -> tuple[bool, Any]:
            if type(value) is not dict or not all(type(k) is str for k in value):
                return False, value
            out = {}
            for key, item in value.items():
                ok, out[key] = nested(item)
                if not ok:
                    return False, value
            return True, out

        return check_map
    test = _predicate(hint)
    return lambda value: (test(value), value)


def _predicate(hint: Any) -> Callable[[Any], bool]:
    """A fast type test for `hint`, built once per field (typing introspection stays here)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return lambda v: True
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if type(None) in args:
            rest = _predicate(typing.Union[tuple(a for a in args if a is not type(None))])  # noqa: UP007
            return lambda v: v is None or rest(v)
        tests = [_predicate(a) for a in args]
        return lambda v: any(t(v) for t in tests)
    if hint is float:
        return lambda v: (type(v) is float) or (isinstance(v, int) and not isinstance(v, bool))
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if hint is str:
        return lambda v: type(v) is str
    if hint is bool:
        return lambda v: type(v) is bool
    if origin is tuple:  # fixed length; msgpack carries a tuple as an array
        tests = [_predicate(a) for a in typing.get_args(hint)]
        return lambda v: (
            type(v) in (list, tuple)
            and len(v) == len(tests)
            and all(t(x) for t, x in zip(tests, v, strict=True))
        )
    if origin is list:
        (item,) = typing.get_args(hint)
        test = _predicate(item)
        return lambda v: type(v) is list and all(map(test, v))
    if origin is dict:
        key, val = typing.get_args(hint)
        test_key, test_val = _predicate(key), _predicate(val)
        if val is Any:
            return lambda v: type(v) is dict and all(map(test_key, v))
        return lambda v: (
            type(v) is dict and all(map(test_key, v)) and all(map(test_val, v.values()))
        )
    return lambda v: isinstance(v, hint)
