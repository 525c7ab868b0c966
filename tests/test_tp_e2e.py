"""Tensor parallelism through the launcher, as a user runs it: `launch_pd.sh --colocated
--tp 2` starts a node whose rank 1 is its own process; the greedy text equals the
single-process engine at TP 1, and a rank that dies takes its node down with no orphan."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from common import LLM, SamplingParams
from common.tokenizer import load_tokenizer
from tests.pd_stack import PDStack, alive, descendants
from tests.tiny_models import save_tiny_tool_model

LAUNCH = ("--num-kv-blocks", "64", "--max-num-batched-tokens", "256", "--max-num-seqs", "8")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [42, 43, 44]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_tool_model(tmp_path_factory.mktemp("tp_e2e") / "model")


@pytest.fixture(scope="module")
def expected(model_dir) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(model_dir), device="cpu", num_kv_blocks=64) as llm:
        return [out.token_ids for out in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("tp_stack") / "launch.log"
    s = PDStack("--model", str(model_dir), "--colocated", "--tp", "2", *LAUNCH, log_path=log)
    yield s
    assert s.stop() == [], "processes left after Ctrl-C"


def completion_text(url: str, prompt: list[int]) -> str:
    body = {
        "model": "model", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
        "ignore_eos": True,
    }  # fmt: skip
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_colocated_tp2_node_reports_two_ranks_and_its_text_equals_tp1(stack, model_dir, expected):
    assert stack.node("colocated")["info"]["tp"] == 2
    tokenizer = load_tokenizer(model_dir)
    assert [completion_text(stack.url, p) for p in PROMPTS] == [
        tokenizer.decode(ids) for ids in expected
    ]


def rank_pids(node_pid: int) -> list[int]:
    """The node's tensor-parallel rank processes (multiprocessing spawn children)."""
    out = []
    for pid in descendants(node_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            out.append(pid)
    return out


def test_a_rank_that_dies_takes_its_node_down_and_leaves_no_process(stack):
    node_pid = stack.node("colocated")["info"]["pid"]
    ranks = rank_pids(node_pid)
    assert len(ranks) == 1
    os.kill(ranks[0], signal.SIGKILL)
    stack.wait_for(lambda: not alive(node_pid), "the node to exit after its rank died")
    assert not any(alive(p) for p in descendants(node_pid))
