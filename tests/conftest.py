"""Shared fixtures: the embedded model through our engine and through HF transformers, and its
source and tokenizer for the router tests."""

from __future__ import annotations

import json
import os
import resource
import time

import pytest
import torch

torch.set_num_threads(max(1, min(4, torch.get_num_threads())))


class TimeRecorder:
    """With PDSERVE_TEST_TIMES_DIR set (scripts/run_tests.sh, on request), each test file's wall
    seconds and CPU seconds (this process and the children it waited for: a stack's processes
    count once the launcher has been reaped) go to DIR/<pid>.json, which `python -m
    tests.shards --merge DIR` folds into tests/test_times.json, the weights shards are dealt by."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, f"{os.getpid()}.json")
        self.files: dict[str, dict[str, float]] = {}

    @staticmethod
    def _cpu() -> float:
        usage = (
            resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        )
        return sum(u.ru_utime + u.ru_stime for u in usage)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        wall, cpu = time.monotonic(), self._cpu()
        yield
        times = self.files.setdefault(item.nodeid.split("::")[0], {"wall_s": 0.0, "cpu_s": 0.0})
        times["wall_s"] += time.monotonic() - wall
        times["cpu_s"] += self._cpu() - cpu

    def pytest_sessionfinish(self):
        rounded = {f: {k: round(v, 1) for k, v in t.items()} for f, t in self.files.items()}
        with open(self.path, "w") as out:
            json.dump(rounded, out, indent=1)


def pytest_configure(config):
    directory = os.environ.get("PDSERVE_TEST_TIMES_DIR")
    if directory:
        config.pluginmanager.register(TimeRecorder(directory), "pdserve-test-times")


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
