"""A config.json that states every value the spec reads is read without transformers
(`common.model.source.stated_config`); the spec must be the one AutoConfig gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig

from common.model.registry import MODELS
from common.model.source import (
    ModelSource,
    generation_eos_ids,
    read_spec,
    resolve_model,
    stated_config,
)
from common.model.spec import ModelSpec
from tests.tiny_models import save_tiny_tool_model

CONFIGS = sorted((Path(__file__).parent.parent / "benchmarks" / "configs").iterdir())


def spec_through_transformers(directory: Path) -> ModelSpec:
    """What read_spec gave before it read config.json itself (eos ids as it takes them)."""
    eos = generation_eos_ids(directory)
    return ModelSpec.from_hf_config(AutoConfig.from_pretrained(directory), eos_token_ids=eos)


@pytest.mark.parametrize("directory", CONFIGS, ids=[c.name for c in CONFIGS])
def test_benchmark_configs_are_read_without_transformers_and_match_it(directory):
    (arch,) = json.loads((directory / "config.json").read_text())["architectures"]
    if arch not in MODELS:
        pytest.skip(f"{arch} has no model class yet")
    assert stated_config(json.loads((directory / "config.json").read_text())) is not None
    assert read_spec(ModelSource(directory, directory.name)) == spec_through_transformers(directory)


def test_the_embedded_models_converted_config_is_read_without_transformers_and_matches_it():
    directory = resolve_model(None).directory
    assert stated_config(json.loads((directory / "config.json").read_text())) is not None
    assert read_spec(ModelSource(directory, "embedded")) == spec_through_transformers(directory)


def test_a_config_that_leaves_values_to_defaults_goes_through_transformers(tmp_path):
    directory = save_tiny_tool_model(tmp_path / "tiny")  # saved as a diff from the defaults
    raw = json.loads((directory / "config.json").read_text())
    raw.pop("max_position_embeddings", None)
    (directory / "config.json").write_text(json.dumps(raw))
    assert stated_config(raw) is None
    assert read_spec(ModelSource(directory, "tiny")) == spec_through_transformers(directory)


@pytest.mark.parametrize(
    "model_type, dropped",
    [
        ("qwen3", "head_dim"),
        ("mistral", "sliding_window"),
        ("llama", "rope_theta"),
        ("llama", "eos_token_id"),
        ("qwen2", "num_key_value_heads"),
    ],
)
def test_class_dependent_defaults_are_left_to_transformers(model_type, dropped):
    raw = json.loads((CONFIGS[0] / "config.json").read_text())
    raw["model_type"] = model_type
    raw.pop("rope_parameters", None)
    raw.pop("rope_scaling", None)
    raw.setdefault("rope_theta", 10000.0)
    raw.setdefault("head_dim", 128)
    raw.setdefault("sliding_window", 4096)
    assert stated_config(raw) is not None
    raw.pop(dropped)
    assert stated_config(raw) is None
