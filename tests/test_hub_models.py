"""Models named by hub id come from the local Hugging Face cache; a missing one is one clear
line. GGUF checkpoints are converted to the serving dtype."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import constants

from common.hub import ModelNotFound, looks_like_hub_id
from common.loader import resolve_model
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
    from safetensors import safe_open

    from common.embedded import embedded_gguf_path

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    directory = resolve_model(str(embedded_gguf_path()), dtype="bfloat16").directory
    assert directory.name.endswith("-bfloat16")
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        dtypes = {str(f.get_tensor(name).dtype) for name in f.keys()}
    assert dtypes == {"torch.bfloat16"}
    assert json.loads((directory / "config.json").read_text())["vocab_size"] == 49152
