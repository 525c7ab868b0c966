"""The FP8 activation seam in the model: with FP8 linear methods every decoder linear (qkv,
o, gate_up, down) receives an `Fp8Activation` from the op that produced its input, in the
method's layout, and the separate quantization (`quantize_input`) never runs; an unquantized
model's linears receive plain tensors, as before."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen3Config

from common import LLM, SamplingParams
from common.model.distributed import TPGroup
from common.model.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    process_weights_after_loading,
)
from common.model.quantization import fp8_ops
from common.model.quantization.activation import Fp8Activation, quantize_activation
from common.model.quantization.config import QuantConfig
from common.model.quantization.fp8 import Fp8BlockMethod, Fp8LinearMethod
from tests.test_fp8_checkpoints import BLOCK_SHAPE, COMMON, OPTIONS

# activation layout -> the config.json quantization_config whose method wants it
SCHEMES = {
    "group": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "token": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "static": {"quant_method": "fp8", "activation_scheme": "static"},
}  # fmt: skip
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
PROMPTS = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1]]  # a prefill step and decode steps


def write_config(folder, quantization: dict | None) -> str:
    config = json.loads(Qwen3Config(**COMMON, **BLOCK_SHAPE).to_json_string())
    if quantization is not None:
        config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def run_recording_inputs(folder: str, **options) -> list[tuple[str, object, LinearBase]]:
    """Greedy generation with every linear layer's inputs recorded as (name, input, layer)."""
    seen: list[tuple[str, object, LinearBase]] = []
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(folder, load_format="dummy", **{**OPTIONS, **options}) as llm:
        model = llm.engine.worker.model
        for name, module in model.named_modules():
            if isinstance(module, LinearBase):
                hook = lambda layer, args, name=name: seen.append((name, args[0], layer))  # noqa: E731
                module.register_forward_pre_hook(hook)
        outputs = llm.generate(PROMPTS, params)
    assert all(len(out.token_ids) == 3 for out in outputs)
    assert {name.rsplit(".", 1)[1] for name, _, _ in seen} == set(LINEARS)
    return seen


@pytest.mark.parametrize("layout", sorted(SCHEMES))
def test_fp8_linears_receive_fp8_from_the_op_that_produced_their_input(
    tmp_path, monkeypatch, layout
):
    def separate_quantization(self, layer, x):
        raise AssertionError("a linear layer quantized its own input")

    monkeypatch.setattr(Fp8LinearMethod, "quantize_input", separate_quantization)
    seen = run_recording_inputs(write_config(tmp_path, SCHEMES[layout]))
    for name, x, layer in seen:
        assert isinstance(x, Fp8Activation), name
        assert x.data.dtype == torch.float8_e4m3fn and x.dtype == torch.float32
        rows, k = x.data.reshape(-1, x.data.shape[-1]).shape
        if layout == "static":
            assert x.scale is layer.input_scale
        else:
            groups = -(-k // 128) if layout == "group" else 1
            assert x.scale.shape == (rows, groups), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_unquantized_model_passes_plain_tensors_to_every_linear(tmp_path, dtype):
    seen = run_recording_inputs(write_config(tmp_path, None), dtype=dtype)
    for name, x, layer in seen:
        assert type(x) is torch.Tensor and x.dtype == getattr(torch, dtype), name
        assert layer.input_quant is None


def test_a_plain_input_and_an_fp8_one_give_the_same_output():
    """`apply` quantizes a tensor exactly as the producing op would have."""
    torch.manual_seed(0)
    method = Fp8BlockMethod(QuantConfig("block", "group", (128, 128), from_checkpoint=False))
    layer = MergedColumnParallelLinear(200, [256, 128], TPGroup.single(), method=method)
    layer.weight.data.copy_(torch.randn(384, 200) * 0.05)
    process_weights_after_loading(layer)
    x = torch.randn(5, 200)
    act = quantize_activation(x, layer.input_quant)
    assert torch.equal(layer(x), layer(act))
    # block_fp8_linear reads each output row's block scales, gathered once after loading
    rows = layer.weight_scale.data[layer.row_block]
    assert layer.weight_scale_rows.shape == (384, 2) and torch.equal(layer.weight_scale_rows, rows)
    w = layer.weight.float() * fp8_ops.expand_groups(rows, 128, 200)
    xd = act.data.float() * fp8_ops.expand_groups(act.scale, 128, 200)
    torch.testing.assert_close(layer(act), xd @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", sorted(SCHEMES))
@pytest.mark.parametrize("eager", [True, False])
def test_on_a_gpu_the_fused_kernels_give_the_logprobs_of_the_unfused_torch_path(
    tmp_path, monkeypatch, layout, eager
):
    """The Triton kernels emit what `fp8_ops` computes from the unfused ops' output, so the
    model's logprobs are bit-equal to those of plain inputs quantized in torch; with graphs
    too (the kernels are captured)."""
    folder = write_config(tmp_path, SCHEMES[layout])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    options = dict(OPTIONS, device="cuda", dtype="bfloat16", enforce_eager=eager)

    def logprobs() -> list[list[float]]:
        with LLM(folder, load_format="dummy", **options) as llm:
            return [out.logprobs for out in llm.generate(PROMPTS, params)]

    fused = logprobs()
    monkeypatch.setattr(LinearBase, "input_quant", property(lambda layer: None))
    monkeypatch.setattr(
        Fp8LinearMethod,
        "quantize_input",
        lambda self, layer, x: quantize_activation(x, self.input_quant(layer)),
    )
    assert fused == logprobs()
