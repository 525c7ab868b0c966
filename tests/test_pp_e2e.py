"""Pipeline parallelism through the launcher, as a user runs it (tiny random Qwen2 of 3 layers,
4 query heads and 2 KV heads; one stack per layout):

- PD `--prefill-pp 2` (layers 1 + 2, explicit partition) into one decode pool: each stage ships
  its own layers (zmq frames naming the model's layer numbers); checked in the failure test,
  which starts that stack anyway;
- PD `--prefill-pp 2` into `--decode-tp 2`: decode rank 0 writes its head of each stage's
  frames and hands the other to its rank;
- PD `--prefill-pp 2 --prefill-tp 2` into `--decode-tp 2` (cuda_ipc, which on CPU sends frames):
  four prefill senders, each one stage's layers of one KV head;
- colocated `--pp 2`: prefill chunks pipelined, decode steps synchronous.

Each gives the text of the single-process engine and frees every block on every node. A stage
holding a prompt's prefill: an abort frees both nodes' blocks; a kill ends the request with an
error, frees the decode node's reservation, leaves none of the prefill node's processes, and
`--restart-nodes` brings the node back.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

from common import LLM, SamplingParams
from tests.pd_stack import PDStack, alive, rank_pids
from tests.tiny_models import save_tiny_tool_model

LAUNCH = ("--num-kv-blocks", "64", "--max-num-batched-tokens", "16", "--max-num-seqs", "8")
# 40 tokens: three chunks of at most 16 tokens flow through the stages back to back.
PROMPTS = [list(range(100, 140)), [42, 43, 44]]
NEW_TOKENS = 8
ABORT_LAYOUT = ("--prefill-pp", "2", "--prefill-pp-layer-partition", "1,2")  # P_pp2-D_tp1
LAYOUTS = {
    "P_pp2-D_tp2": ("--prefill-pp", "2", "--decode-tp", "2"),
    "P_pp2xtp2-D_tp2-cuda_ipc": (
        "--prefill-pp", "2", "--prefill-tp", "2", "--decode-tp", "2", "--transport", "cuda_ipc",
    ),
    "colocated_pp2": ("--colocated", "--pp", "2"),
}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_tool_model(tmp_path_factory.mktemp("pp_e2e") / "model", num_layers=3)


@pytest.fixture(scope="module")
def expected(model_dir) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(model_dir), device="cpu", num_kv_blocks=64) as llm:
        return [out.text for out in llm.generate(PROMPTS, params)]  # the router's detokenizer


def completion(url: str, prompt: list[int], timeout: float = 120) -> httpx.Response:
    body = {
        "model": "model", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
        "ignore_eos": True,
    }  # fmt: skip
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def stop(stack) -> None:
    """Ctrl-C the launcher; every process it started exits (rank processes may take a moment
    longer than their node: they exit once they see it gone)."""
    left = stack.stop()
    stack.wait_for(lambda: not any(alive(p) for p in left), f"processes {left} to exit", 30)


def all_blocks_freed(stack) -> None:
    stack.wait_for(
        lambda: all(n["load"]["used_blocks"] == 0 for n in stack.get("/health")[1]["nodes"]),
        "every node's blocks freed",
    )


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_greedy_text_equals_one_process_and_every_block_is_freed(
    layout, model_dir, expected, tmp_path
):
    stack = PDStack("--model", str(model_dir), *LAYOUTS[layout], *LAUNCH,
                    log_path=tmp_path / "launch.log")  # fmt: skip
    try:
        texts = []
        for prompt in PROMPTS:
            r = completion(stack.url, prompt)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert texts == expected
        nodes = stack.get("/health")[1]["nodes"]
        pipelined = [n for n in nodes if n["info"].get("pp") == 2]
        assert len(pipelined) == 1
        assert sum(pipelined[0]["info"]["pp_layers"]) == 3
        for node in nodes:
            assert node["load"].get("kv_transfer_failures", 0) == 0
        all_blocks_freed(stack)
    finally:
        stop(stack)


def test_an_abort_and_a_killed_stage_mid_prefill_leak_nothing(model_dir, expected, tmp_path):
    """Stage 1 is stopped (SIGSTOP) before a request comes, so its prefill is held there with
    the decode node's blocks reserved. First the client gives up: the router aborts the
    request on both nodes; once stage 1 goes on, every block is free on both and the node
    serves again. Then, stopped again under a second request, stage 1 is killed: that request
    ends with an error, the decode node's reservation is freed, none of the prefill node's
    processes is left, and `--restart-nodes` brings the node back."""
    stack = PDStack("--model", str(model_dir), *ABORT_LAYOUT, *LAUNCH,
                    "--heartbeat-timeout", "2", "--restart-nodes",
                    log_path=tmp_path / "launch.log")  # fmt: skip
    try:
        for prompt, text in zip(PROMPTS, expected, strict=True):  # as one process, first
            r = completion(stack.url, prompt)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == text, r.text
        info = stack.node("prefill")["info"]
        assert (info["pp"], info["pp_layers"]) == (2, [1, 2])
        all_blocks_freed(stack)
        node_pid = info["pid"]
        (stage,) = rank_pids(node_pid)
        decode_used = lambda: stack.node("decode")["load"]["used_blocks"]  # noqa: E731

        os.kill(stage, signal.SIGSTOP)
        with pytest.raises(httpx.TimeoutException):
            completion(stack.url, PROMPTS[0], timeout=2)  # reserved by then, then abandoned
        stack.wait_for(lambda: decode_used() == 0, "the abort to free the decode reservation")
        os.kill(stage, signal.SIGCONT)
        all_blocks_freed(stack)
        r = completion(stack.url, PROMPTS[1])
        assert r.status_code == 200, r.text

        os.kill(stage, signal.SIGSTOP)
        result: dict[str, httpx.Response] = {}
        client = threading.Thread(
            target=lambda: result.update(r=completion(stack.url, PROMPTS[0], timeout=60))
        )
        client.start()
        stack.wait_for(lambda: decode_used() > 0, "the decode node to reserve the prompt's blocks")
        os.kill(stage, signal.SIGKILL)
        client.join(60)
        assert not client.is_alive()
        assert result["r"].status_code >= 500, result["r"].text
        assert "error" in result["r"].json()
        for pid, what in ((stage, "the stage"), (node_pid, "the prefill node")):
            stack.wait_for(lambda pid=pid: not alive(pid), f"{what} to exit")
        stack.wait_for(lambda: decode_used() == 0, "the decode node's reservation freed")
        stack.wait_for(
            lambda: any(
                n["role"] == "prefill" and n["info"]["pid"] != node_pid and n["healthy"]
                for n in stack.get("/health")[1]["nodes"]
            ),
            "the prefill node restarted",
            timeout_s=120,
        )
        r = completion(stack.url, PROMPTS[1])
        assert r.status_code == 200, r.text
    finally:
        stop(stack)
