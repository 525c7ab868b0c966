"""FP8 at start-up: a quantization method pdserve lacks stops with one line, `--quantization
fp8` quantizes the embedded model at load, dummy weights quantize in the checkpoint's FP8
layout (what GPU benchmarks run), and KV-cache scales are kept, not refused."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen3Config

from common import LLM, SamplingParams
from common.model.quantization.config import parse_quantization_config
from common.model.source import ModelSource, read_spec
from tests.test_fp8_checkpoints import BLOCK_SHAPE, COMMON, OPTIONS

SUPPORTED = (
    "supported: fp8 (HF, per-tensor or 128x128 blocks), compressed-tensors FP8 "
    "(per-channel or per-tensor), or --quantization fp8 on a bf16/fp16/fp32 checkpoint"
)


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes", "marlin"])
def test_an_unsupported_method_stops_at_start_with_one_line_naming_it(tmp_path, method):
    config = json.loads(Qwen3Config(**COMMON, **BLOCK_SHAPE).to_json_string())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        read_spec(ModelSource(tmp_path, "m"))  # what the launcher reads before any process
    line = f"quantization method {method!r} of this checkpoint is not supported; {SUPPORTED}"
    assert str(error.value) == line
    with pytest.raises(ValueError, match=f"quantization method '{method}'"):
        LLM(str(tmp_path), load_format="dummy", device="cpu")


def test_compressed_tensors_int4_is_refused_naming_its_scheme():
    group = {"weights": {"type": "int", "num_bits": 4, "strategy": "group"}}
    raw = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    with pytest.raises(ValueError, match="compressed-tensors format 'pack-quantized'"):
        parse_quantization_config({**raw, "config_groups": {"g": group}})
    raw["format"] = "float-quantized"
    with pytest.raises(ValueError, match=r"weights int4 group, activations None"):
        parse_quantization_config({**raw, "config_groups": {"g": group}})


def test_routers_may_be_left_unquantized_but_no_other_decoder_layer():
    """MoE checkpoints list their routers as llm-compressor writes them, by name or pattern;
    pdserve never quantizes routers, so these load. Any other layer left out is refused."""
    from tests.fp8_checkpoints import FORMATS

    raw = FORMATS["ct_channel"][0]
    routers = ["lm_head", "re:.*mlp.gate$", "model.layers.0.mlp.gate", "re:.*block_sparse_moe.gate"]
    assert parse_quantization_config({**raw, "ignore": routers}).weights == "channel"
    hf = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    assert parse_quantization_config({**hf, "modules_to_not_convert": routers[1:]}) is not None
    with pytest.raises(ValueError, match=r"leaves layers \['model.layers.0.mlp.gate_proj'\]"):
        parse_quantization_config({**raw, "ignore": [*routers, "model.layers.0.mlp.gate_proj"]})


def test_quantization_fp8_on_the_embedded_model_loads_and_generates():
    params = SamplingParams(temperature=0, max_tokens=8)
    with LLM(device="cpu", quantization="fp8", max_num_batched_tokens=512) as llm:
        text = llm.generate(["The capital of France is"], params)[0].text
        model = llm.engine.worker.model
    assert "Paris" in text
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert model.lm_head.weight.dtype == torch.float32


def test_dummy_weights_of_a_block_fp8_config_quantize_at_load_in_blocks(tmp_path):
    config = json.loads(Qwen3Config(**COMMON, **BLOCK_SHAPE).to_json_string())
    config["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(str(tmp_path), load_format="dummy", **OPTIONS) as llm:
        assert len(llm.generate([[5, 6, 7]], params)[0].token_ids) == 4
        layer = llm.engine.worker.model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale_inv.shape == (6, 2)  # q, k, v: 256 rows each, 256 columns


def test_kv_cache_scales_in_the_checkpoint_are_kept_on_attention(tmp_path):
    from tests.fp8_checkpoints import write
    from tests.test_fp8_checkpoints import MODELS

    cls, make_config = MODELS["ct_channel"]
    torch.manual_seed(0)
    write(cls(make_config()).eval(), tmp_path, "ct_channel", torch.arange(3, 20))
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor([0.25])  # older name
    save_file(tensors, tmp_path / "model.safetensors")
    with LLM(str(tmp_path), **OPTIONS) as llm:
        layers = llm.engine.worker.model.model.layers
    assert layers[0].self_attn.k_scale.item() == 0.5 and layers[0].self_attn.v_scale.item() == 1
    assert layers[1].self_attn.v_scale.item() == 0.25
