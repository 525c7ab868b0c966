"""Models named by hub id come from the local Hugging Face cache; a missing one is one clear
line. GGUF checkpoints are converted to the serving dtype."""

from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub import constants

from common.model.hub import ModelNotFound, looks_like_hub_id
from common.model.source import resolve_model
from tests.tiny_models import hub_cache_layout, save_tiny_tool_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_tool_model(tmp_path_factory.mktemp("tiny") / "model")


def test_hub_ids_are_told_apart_from_paths():
    assert looks_like_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert looks_like_hub_id("org/name.v2")
    for path in ("./org/name", "/abs/path", "~/m", "name", "a/b/c", "model.gguf"):
        assert not looks_like_hub_id(path), path


def test_a_cached_snapshot_is_served_by_its_hub_id(tmp_path, tiny_model, monkeypatch):
    snapshot = hub_cache_layout(tmp_path / "hub", "tiny-org/tiny-tools", tiny_model)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    source = resolve_model("tiny-org/tiny-tools")
    assert source.directory == snapshot and source.name == "tiny-org/tiny-tools"


def test_a_missing_hub_id_is_one_line_saying_where_and_how(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ModelNotFound) as info:
        resolve_model("no-org/no-model")
    message = str(info.value)
    assert "\n" not in message
    assert str(tmp_path / "empty-hub") in message and "hf download no-org/no-model" in message


def test_a_path_that_is_neither_file_nor_directory_is_model_not_found(tmp_path):
    with pytest.raises(ModelNotFound, match="not a directory"):
        resolve_model(str(tmp_path / "nothing" / "here" / "x"))


def test_gguf_is_converted_to_the_serving_dtype(tmp_path, monkeypatch):
    """bfloat16 from the cached float32 conversion (the session's, linked into a fresh cache):
    the same tensors cast, the same other files, the config's dtype changed."""
    from safetensors import safe_open

    from common.model.embedded import embedded_gguf_path

    gguf = str(embedded_gguf_path())
    float32 = resolve_model(gguf).directory
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / float32.name).symlink_to(float32)
    directory = resolve_model(gguf, dtype="bfloat16").directory
    assert directory.name.endswith("-bfloat16") and directory.parent == tmp_path / "gguf"
    with (
        safe_open(str(directory / "model.safetensors"), framework="pt") as ours,
        safe_open(str(float32 / "model.safetensors"), framework="pt") as source,
    ):
        assert set(ours.keys()) == set(source.keys())
        for name in ours.keys():
            tensor = ours.get_tensor(name)
            assert tensor.dtype == torch.bfloat16, name
            assert torch.equal(tensor, source.get_tensor(name).to(torch.bfloat16)), name
    config = json.loads((directory / "config.json").read_text())
    assert config["vocab_size"] == 49152 and config["dtype"] == "bfloat16"
    assert sorted(p.name for p in directory.iterdir()) == sorted(p.name for p in float32.iterdir())
