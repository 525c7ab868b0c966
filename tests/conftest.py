"""Shared fixtures: the embedded model through our engine and through HF transformers, and its
source and tokenizer for the router tests."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(max(1, min(4, torch.get_num_threads())))


@pytest.fixture(scope="session")
def smollm_dir():
    from common.model.source import resolve_model

    return resolve_model(None).directory


@pytest.fixture(scope="session")
def smollm_llm():
    from common import LLM

    return LLM(device="cpu", max_num_batched_tokens=512)


@pytest.fixture(scope="session")
def smollm_hf(smollm_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def source(smollm_dir):
    """The embedded model as the router sees it (tests name it `source`)."""
    from common.model.loader import ModelSource

    return ModelSource(smollm_dir, "SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def tokenizer(source):
    from common.text.tokenizer import load_tokenizer

    return load_tokenizer(source.directory)
