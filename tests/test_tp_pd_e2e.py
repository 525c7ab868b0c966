"""PD between pools of different tensor-parallel sizes through the launcher: each prefill
rank ships its KV heads (zmq frames with their head range), the decode node's rank 0 writes
its heads and hands the others to its ranks, and the greedy text equals the single-process
engine at TP 1 (which the colocated tests equal).

P TP2 -> D TP1: two senders fill one pool. P TP1 -> D TP2: one frame per layer carries both
KV heads, split between the decode ranks. The tiny Qwen2 has 2 KV heads."""

from __future__ import annotations

import httpx
import pytest

from common import LLM, SamplingParams
from tests.pd_stack import PDStack
from tests.tiny_models import save_tiny_tool_model

LAUNCH = ("--num-kv-blocks", "64", "--max-num-batched-tokens", "256", "--max-num-seqs", "8")
# 40 tokens: three blocks of 16, so a transfer spans several blocks and a partial one.
PROMPTS = [list(range(100, 140)), [42, 43, 44]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_tool_model(tmp_path_factory.mktemp("tp_pd") / "model")


@pytest.fixture(scope="module")
def expected(model_dir) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(model_dir), device="cpu", num_kv_blocks=64) as llm:
        return [out.text for out in llm.generate(PROMPTS, params)]  # the router's detokenizer


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["P_tp2-D_tp1", "P_tp1-D_tp2"])
def stack(request, model_dir, tmp_path_factory):
    p, d = request.param
    log = tmp_path_factory.mktemp("tp_pd_stack") / "launch.log"
    args = ("--model", str(model_dir), "--prefill-tp", str(p), "--decode-tp", str(d))
    s = PDStack(*args, *LAUNCH, log_path=log)
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


def test_pd_between_tp_sizes_gives_the_text_of_tp1_and_frees_every_block(stack, expected):
    assert [completion_text(stack.url, p) for p in PROMPTS] == expected
    assert stack.node("decode")["load"].get("kv_transfer_failures", 0) == 0
    stack.wait_for(lambda: stack.node("decode")["load"]["used_blocks"] == 0, "blocks freed")
    stack.wait_for(lambda: stack.node("prefill")["load"]["used_blocks"] == 0, "blocks freed")
