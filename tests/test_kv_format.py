"""`KVFormat`: what two KV pools must agree on; equal formats match, a mismatch names every
differing field with both values, and a format survives the heartbeat's msgpack trip."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from common.engine.kv_format import KVFormat, quantization_name, scales_summary
from common.model.quantization.config import QUANTIZE_AT_LOAD, QuantConfig
from common.model.spec import KVCacheGeometry

BF16 = KVFormat(
    kv_dtype="bfloat16",
    kv_scales="none",
    quantization="none",
    architecture="Qwen2ForCausalLM",
    num_layers=30,
    planes=2,
    num_kv_heads=3,
    head_dim=64,
    block_size=16,
)
FP8 = dataclasses.replace(BF16, kv_dtype="float8_e4m3fn", kv_scales="all 1.0")
# DeepSeek-V2-Lite's MLA cache: one latent plane, one head of kv_lora_rank 512 + rope 64.
LATENT = dataclasses.replace(
    BF16, architecture="DeepseekV2ForCausalLM", num_layers=27, planes=1, num_kv_heads=1,
    head_dim=576,
)  # fmt: skip


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


def test_describe_is_one_short_line_with_dtype_scales_weights_and_cache_geometry():
    assert FP8.describe() == (
        "float8_e4m3fn KV (scales all 1.0), weights none, Qwen2ForCausalLM K/V 3 heads x 64 "
        "(30 layers), 16-token blocks"
    )
    assert LATENT.describe() == (
        "bfloat16 KV, weights none, DeepseekV2ForCausalLM latent 1 x 576 (27 layers), "
        "16-token blocks"
    )


def test_a_latent_pool_and_a_kv_pool_name_their_geometries_side_by_side():
    message = LATENT.mismatch(BF16, ("prefill P", "decode D"))
    assert message == (
        "architecture DeepseekV2ForCausalLM (prefill P) vs Qwen2ForCausalLM (decode D); "
        "num_layers 27 (prefill P) vs 30 (decode D); "
        "cache geometry latent 1 x 576 (prefill P) vs K/V 3 heads x 64 (decode D)"
    )
    # One architecture, planes alone differ (a pool built without MLA's geometry).
    kv_shaped = dataclasses.replace(LATENT, planes=2)
    assert LATENT.mismatch(kv_shaped, ("p", "d")) == (
        "cache geometry latent 1 x 576 (p) vs K/V 1 heads x 576 (d)"
    )


def test_the_format_of_a_spec_is_its_kv_cache_geometry():
    assert BF16.geometry == KVCacheGeometry(2, 3, 64)
    assert LATENT.geometry == KVCacheGeometry(1, 1, 576)


@pytest.mark.parametrize(
    "field, value, names",
    [("planes", 3, "planes must be 1 .* or 2 .* got 3"), ("head_dim", 0, "'head_dim': 0")],
)
def test_an_impossible_geometry_is_a_value_error_naming_it(field, value, names):
    with pytest.raises(ValueError, match=names):
        dataclasses.replace(LATENT, **{field: value})
    with pytest.raises(ValueError, match=names):
        KVFormat.from_dict({**LATENT.to_dict(), field: value})


@pytest.mark.parametrize(
    "raw, names",
    [
        ({**BF16.to_dict(), "block_size": "16"}, "block_size"),
        ({**BF16.to_dict(), "planes": 2.0}, "planes"),
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
