"""The control-message codec: round trips, token arrays as raw int32 bytes, hostile frames."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from common.protocol.messages import (
    Abort,
    DecodeRequest,
    FirstToken,
    Heartbeat,
    MessageError,
    PrefillRequest,
    RequestError,
    Reservation,
    TokenBatch,
    decode,
    encode,
    int_array,
)
from common.protocol.sampling_params import SamplingParams

SAMPLING = SamplingParams(temperature=0.0, max_tokens=8, stop=["x"], logit_bias={7: -1.5})


def roundtrip(message):
    return decode(encode(message))


def test_every_message_survives_a_round_trip():
    messages = [
        PrefillRequest("r", [1, 2, 3], SAMPLING, "tcp://d", "tcp://d-kv"),
        DecodeRequest("r", [1, 2, 3], SAMPLING, None),
        Abort("r"),
        Reservation("r", "tcp://d", [4, 5]),
        FirstToken("r", 7, -0.5, [[7, -0.5]], False, None, 16, {"prefill_compute": 0.1}),
        TokenBatch(["a", "b"], [1, 2], [None, "stop"], [-0.1, None], [[[1, -0.1]], None]),
        RequestError("r", "boom", 503),
        Heartbeat("tcp://n", "decode", {"vocab_size": 10}, {"running": 2}),
    ]
    for message in messages:
        back = roundtrip(message)
        assert type(back) is type(message)
        for name, value in vars(message).items():
            got = getattr(back, name)
            if isinstance(value, np.ndarray):
                assert got.dtype == np.dtype("<i4") and got.tolist() == value.tolist()
            else:
                assert got == value


def test_token_ids_travel_as_one_bin_of_little_endian_int32():
    ids = list(range(100, 8292))
    frame = encode(PrefillRequest("r", ids, SAMPLING, "tcp://d", "tcp://d-kv"))
    raw = msgpack.unpackb(frame)
    assert raw["prompt_token_ids"] == np.asarray(ids, dtype="<i4").tobytes()
    empty = encode(PrefillRequest("r", [], SAMPLING, "tcp://d", "tcp://d-kv"))
    assert len(frame) <= len(empty) + 4 * len(ids) + 4  # no per-token encoding
    back = decode(frame)
    assert not back.prompt_token_ids.flags.writeable  # a view of the frame, read-only


def test_a_locally_built_message_holds_the_same_array_type_as_a_decoded_one():
    local = DecodeRequest("r", [5, 6], SAMPLING, None)
    assert isinstance(local.prompt_token_ids, np.ndarray)
    assert local.prompt_token_ids.dtype == np.dtype("<i4")
    assert local.prompt_token_ids.tolist() == [5, 6]
    array = np.arange(3, dtype="<i4")
    assert DecodeRequest("r", array, SAMPLING, None).prompt_token_ids is array  # no copy


@pytest.mark.parametrize(
    "values", [[1, 2**31], [[1, 2], [3, 4]], ["a"], [1.5], np.zeros(3, dtype=np.float32)]
)
def test_int_array_refuses_what_is_not_int32(values):
    with pytest.raises(MessageError):
        int_array(values)


def frame_with(message, **fields) -> bytes:
    raw = msgpack.unpackb(encode(message))
    raw.update(fields)
    return msgpack.packb(raw, use_bin_type=True)


@pytest.mark.parametrize(
    "fields, error",
    [
        ({"prompt_token_ids": b"\x01\x00\x00"}, "prompt_token_ids: wrong type"),
        ({"prompt_token_ids": [1, 2]}, "prompt_token_ids: wrong type"),
        ({"prompt_token_ids": "abcd"}, "prompt_token_ids: wrong type"),
        ({"request_id": 5}, "request_id: wrong type"),
        ({"sampling": {1: 2}}, "undecodable frame"),  # non-str map key: msgpack refuses
        ({"sampling": [1]}, "sampling: wrong type"),
        ({"sampling": {"temperature": "hot"}}, r"sampling: SamplingParams\.temperature: wrong"),
        ({"sampling": {"logit_bias": [[1, 2, 3]]}}, "SamplingParams.logit_bias: wrong type"),
        ({"sampling": {"top_p": 0.0}}, r"sampling: SamplingParams: top_p must be in \(0, 1\]"),
        ({"sampling": {"surprise": 1}}, "SamplingParams: unknown fields"),
        ({"surprise": 1}, "unknown fields"),
        ({"type": "Nope"}, "unknown message type"),
    ],
)
def test_hostile_frames_are_refused_with_a_clear_error(fields, error):
    message = PrefillRequest("r", [1, 2], SAMPLING, "tcp://d", "tcp://d-kv")
    with pytest.raises(MessageError, match=error):
        decode(frame_with(message, **fields))


def test_sampling_params_arrive_as_sampling_params_equal_to_the_sent_ones():
    back = roundtrip(DecodeRequest("r", [1], SAMPLING, None)).sampling
    assert isinstance(back, SamplingParams) and back == SAMPLING
    assert back.logit_bias == [(7, -1.5)]  # pairs again, not msgpack's lists


def test_missing_fields_and_garbage_are_refused():
    raw = msgpack.unpackb(encode(Abort("r")))
    del raw["request_id"]
    with pytest.raises(MessageError, match="missing field"):
        decode(msgpack.packb(raw))
    for garbage in (b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"type": 3})):
        with pytest.raises(MessageError):
            decode(garbage)


def test_token_batch_columns_must_agree():
    with pytest.raises(MessageError, match="differ in length"):
        TokenBatch(["a", "b"], [1], [None, None])
    with pytest.raises(MessageError, match="finish reasons"):
        TokenBatch(["a"], [1], ["bored"])
    with pytest.raises(MessageError, match="differ in length"):
        decode(frame_with(TokenBatch(["a"], [1], [None]), logprobs=[0.1, 0.2]))


def test_token_batch_items_give_each_request_its_tokens_and_first_timing():
    batch = TokenBatch(
        ["a", "b", "a"],
        [1, 2, 3],
        [None, "length", "stop"],
        None,
        None,
        {"a": {"decode_admission_wait": 0.5}},
    )
    a1, b, a2 = roundtrip(batch).items()
    assert (a1.request_id, a1.token_ids, a1.finished, a1.timing) == (
        "a",
        [1],
        False,
        {"decode_admission_wait": 0.5},
    )
    assert (b.token_ids, b.finished, b.finish_reason, b.timing) == ([2], True, "length", None)
    assert (a2.token_ids, a2.finish_reason, a2.timing, a2.logprobs) == ([3], "stop", None, None)
