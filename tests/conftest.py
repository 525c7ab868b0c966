"""Shared fixtures: the embedded model through our engine and through HF transformers, and its
source and tokenizer for the router tests."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(4, torch.get_num_threads())))


def pytest_collection_modifyitems(config, items):
    """`PDSERVE_TEST_SHARD=i/n` (scripts/run_tests.sh) keeps the test files of shard i of n:
    whole files, so module fixtures are built once, dealt heaviest first to the lighter shard
    (file size stands in for run time, plus a share for each stack of processes it starts)."""
    shard = os.environ.get("PDSERVE_TEST_SHARD")
    if not shard:
        return
    index, count = (int(part) for part in shard.split("/"))
    loads = [0] * count
    owner = {}
    weights = {path: _weight(path) for path in {item.path for item in items}}
    for path in sorted(weights, key=lambda p: (-weights[p], p)):
        lightest = loads.index(min(loads))
        owner[path] = lightest
        loads[lightest] += weights[path]
    keep = [item for item in items if owner[item.path] == index]
    config.hook.pytest_deselected(items=[item for item in items if owner[item.path] != index])
    items[:] = keep


STACK_WEIGHT = 20_000  # bytes of test code that run about as long as starting one stack


def _weight(path) -> int:
    text = path.read_text()
    return len(text) + STACK_WEIGHT * text.count("PDStack(")


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
