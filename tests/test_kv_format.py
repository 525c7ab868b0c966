"""`KVFormat`: what two KV pools must agree on; equal formats match, a mismatch names every
differing field with both values, and a format survives the heartbeat's msgpack trip."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from common.engine.kv_format import KVFormat, quantization_name, scales_summary
from common.model.quantization.config import QUANTIZE_AT_LOAD, QuantConfig

BF16 = KVFormat("bfloat16", "none", "none", 30, 3, 64, 16)
FP8 = dataclasses.replace(BF16, kv_dtype="float8_e4m3fn", kv_scales="all 1.0")


def test_equal_formats_have_no_mismatch_and_survive_msgpack():
    wire = msgpack.unpackb(msgpack.packb(FP8.to_dict()))
    assert KVFormat.from_dict(wire) == FP8
    assert FP8.mismatch(KVFormat.from_dict(wire)) is None


def test_a_mismatch_names_every_differing_field_with_both_values_and_sides():
    other = dataclasses.replace(BF16, block_size=32, quantization="fp8 channel weights")
    message = FP8.mismatch(other, ("prefill tcp://p", "decode tcp://d"))
    assert message == (
        "kv_dtype float8_e4m3fn (prefill tcp://p) vs bfloat16 (decode tcp://d); "
        "kv_scales all 1.0 (prefill tcp://p) vs none (decode tcp://d); "
        "quantization none (prefill tcp://p) vs fp8 channel weights (decode tcp://d); "
        "block_size 16 (prefill tcp://p) vs 32 (decode tcp://d)"
    )


def test_describe_is_one_short_line_with_dtype_scales_weights_and_layout():
    assert FP8.describe() == (
        "float8_e4m3fn KV (scales all 1.0), weights none, 30 layers x 3 KV heads x 64, "
        "16-token blocks"
    )
    assert BF16.describe().startswith("bfloat16 KV, weights none")


@pytest.mark.parametrize(
    "raw, names",
    [
        ({**BF16.to_dict(), "block_size": "16"}, "block_size"),
        ({**BF16.to_dict(), "num_layers": True}, "num_layers"),
        ({k: v for k, v in BF16.to_dict().items() if k != "head_dim"}, "head_dim"),
        ({**BF16.to_dict(), "colour": "red"}, "colour"),
        (["bfloat16"], "map"),
    ],
)
def test_a_malformed_format_is_a_value_error_naming_the_field(raw, names):
    with pytest.raises(ValueError, match=names):
        KVFormat.from_dict(raw)


def test_scales_summary_is_exact_when_few_or_uniform_and_a_digest_otherwise():
    assert scales_summary([1.0] * 32, [1.0] * 32) == "all 1.0"
    assert scales_summary([0.5, 1.0], [1.0, 0.25]) == "k 0.5,1.0 v 1.0,0.25"
    many = [0.5] * 31 + [0.25]
    digest = scales_summary(many, [1.0] * 32)
    assert digest.startswith("sha256:") and "k 0.25..0.5, v 1.0..1.0" in digest
    assert scales_summary(many, [1.0] * 32) == digest  # deterministic
    assert scales_summary([0.5] * 32, [1.0] * 32) != digest  # one layer's scale differs
    with pytest.raises(ValueError, match="3 K scales but 2 V scales"):
        scales_summary([1.0] * 3, [1.0] * 2)


def test_quantization_name_states_the_scheme_that_computes_k_and_v():
    assert quantization_name(None) == "none"
    assert quantization_name(QUANTIZE_AT_LOAD) == "fp8 channel weights, token activations"
    block = QuantConfig("block", "group", (128, 128), scale_name="weight_scale_inv")
    assert quantization_name(block) == "fp8 block 128x128 weights, group activations"
