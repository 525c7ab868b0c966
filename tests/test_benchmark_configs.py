"""The real architectures in benchmarks/configs/ build with dummy weights on the meta device
(shapes only, no memory), with exactly the parameters HF transformers builds from the same
config.json, within 1% of each model's published size."""

from __future__ import annotations

import json

import pytest
import torch

from common.model.loader import build_model
from common.model.registry import MODELS
from common.model.source import read_spec, resolve_model
from tests.pd_stack import ROOT

CONFIGS = ROOT / "benchmarks" / "configs"
PUBLISHED_BILLIONS = {  # the size on each model card
    "llama-3.1-8b-instruct": 8.03,
    "llama-3.1-70b-instruct": 70.6,
    "qwen2.5-7b-instruct": 7.61,
    "qwen2.5-32b-instruct": 32.8,
    "qwen3-8b": 8.19,
    "qwen3-30b-a3b": 30.5,
    "mixtral-8x7b": 46.7,
    "deepseek-v2-lite": 15.7,
    "moonlight-16b-a3b": 16.0,
}


def test_every_config_has_a_published_size():
    assert sorted(p.name for p in CONFIGS.iterdir()) == sorted(PUBLISHED_BILLIONS)


@pytest.mark.parametrize("name", sorted(PUBLISHED_BILLIONS))
def test_dummy_model_on_meta_has_the_published_and_hf_parameter_count(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    source = resolve_model(str(CONFIGS / name))
    (arch,) = json.loads((source.directory / "config.json").read_text())["architectures"]
    if arch not in MODELS:
        pytest.skip(f"{arch} has no model class yet")
    model = build_model(
        read_spec(source), source, max_positions=4096, dtype=torch.bfloat16,
        device=torch.device("meta"), load_format="dummy",
    )  # fmt: skip
    assert all(p.is_meta for p in model.parameters())
    ours = sum(p.numel() for p in model.parameters())
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source.directory))
    # DeepSeek-V3's router bias is a checkpoint tensor HF keeps as a buffer, ours a parameter.
    biases = [b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")]
    assert ours == sum(p.numel() for p in hf.parameters()) + sum(b.numel() for b in biases)
    assert ours / 1e9 == pytest.approx(PUBLISHED_BILLIONS[name], rel=0.01)
    config = json.loads((source.directory / "config.json").read_text())
    assert len(model.model.layers) == config["num_hidden_layers"]
