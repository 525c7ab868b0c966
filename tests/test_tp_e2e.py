"""Tensor parallelism through the launcher, as a user runs it (tiny random Qwen2 with 4 query
heads and 2 KV heads, few tokens; one stack per layout):

- colocated `--tp 2`: one node whose rank 1 is its own process;
- PD `--prefill-tp 2 --decode-tp 1`: two prefill ranks each ship their KV head (zmq frames
  with their head range) into one decode pool;
- PD `--prefill-tp 1 --decode-tp 2`: one frame per layer carries both heads; the decode node's
  rank 0 writes its head and hands the other to its rank;
- both PD layouts with `--transport cuda_ipc`: on CPU every sending rank falls back to frames
  (the GPU's direct writes: tests/test_tp_cuda_ipc_gpu.py).

Each gives the text of the single-process engine at TP 1 (which colocated TP 1 equals,
tests/test_pd_faults.py), frees every block, and a rank or node that dies leaves no process.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from common import LLM, SamplingParams
from tests.pd_stack import PDStack, alive, rank_pids
from tests.tiny_models import save_tiny_tool_model

LAUNCH = ("--num-kv-blocks", "64", "--max-num-batched-tokens", "256", "--max-num-seqs", "8")
# 40 tokens: three blocks of 16, so a transfer spans full blocks and a partial one.
PROMPTS = [list(range(100, 140)), [42, 43, 44]]
NEW_TOKENS = 8
LAYOUTS = {
    "colocated_tp2": ("--colocated", "--tp", "2"),
    "P_tp2-D_tp1": ("--prefill-tp", "2", "--decode-tp", "1"),
    "P_tp1-D_tp2": ("--prefill-tp", "1", "--decode-tp", "2"),
    "P_tp2-D_tp1-cuda_ipc": ("--prefill-tp", "2", "--decode-tp", "1", "--transport", "cuda_ipc"),
    "P_tp1-D_tp2-cuda_ipc": ("--prefill-tp", "1", "--decode-tp", "2", "--transport", "cuda_ipc"),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_tool_model(tmp_path_factory.mktemp("tp_e2e") / "model")


@pytest.fixture(scope="module")
def expected(model_dir) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(model_dir), device="cpu", num_kv_blocks=64) as llm:
        return [out.text for out in llm.generate(PROMPTS, params)]  # the router's detokenizer


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def stack(request, model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("tp_stack") / "launch.log"
    s = PDStack("--model", str(model_dir), *LAYOUTS[request.param], *LAUNCH, log_path=log)
    s.layout = request.param
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


def tp_node(stack) -> dict:
    """The node of the layout that has two ranks."""
    nodes = stack.get("/health")[1]["nodes"]
    return next(n for n in nodes if n["info"]["tp"] == 2)


def test_greedy_text_equals_tp1_and_every_block_is_freed(stack, expected):
    assert [completion_text(stack.url, p) for p in PROMPTS] == expected
    for node in stack.get("/health")[1]["nodes"]:
        assert node["load"].get("kv_transfer_failures", 0) == 0
    stack.wait_for(
        lambda: all(n["load"]["used_blocks"] == 0 for n in stack.get("/health")[1]["nodes"]),
        "every node's blocks freed",
    )
    if stack.layout.endswith("cuda_ipc"):  # one warning per sending rank
        senders = 2 if stack.layout.startswith("P_tp2") else 1
        assert stack.log_path.read_text().count("goes as frames through host memory") == senders


def test_a_dead_rank_takes_its_node_down_and_a_dead_node_its_ranks(stack):
    """Colocated: SIGKILL the rank, the node exits. PD: SIGKILL the node, its rank exits."""
    node_pid = tp_node(stack)["info"]["pid"]
    (rank,) = rank_pids(node_pid)
    os.kill(rank if stack.layout == "colocated_tp2" else node_pid, signal.SIGKILL)
    for pid, what in ((node_pid, "the node"), (rank, "its rank")):
        stack.wait_for(lambda pid=pid: not alive(pid), f"{what} to exit")
