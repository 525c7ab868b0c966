"""Nodes that join, leave and come back while the stack serves, and a decode pool too small
for its load (real processes, the embedded model): a prefill node started by hand registers
and takes traffic, SIGTERM drains a node (its in-flight request finishes), a node killed under
load is restarted by the launcher (--restart-nodes) and rejoins, and a decode node out of KV
blocks preempts and recomputes without changing any answer. One stack for the module: prefill
pool in round robin, a decode pool of 12 blocks (192 tokens)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from common import SamplingParams
from tests.pd_stack import ROOT, PDStack
from tests.router_fakes import metric

MODEL = "SmolLM2-135M-Instruct"
DECODE_BLOCKS = 12


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = PDStack(
        "--restart-nodes",
        "--router-prefill-policy", "round_robin",
        "--router-heartbeat-timeout", "2",
        "--decode-num-kv-blocks", str(DECODE_BLOCKS),
        "--prefill-num-kv-blocks", "256",  # small pools: less memory on a shared machine
        log_path=tmp_path_factory.mktemp("lifecycle") / "launch.log",
    )  # fmt: skip
    yield s
    assert s.stop() == [], "processes left after Ctrl-C"


def complete(stack: PDStack, max_tokens: int = 4) -> httpx.Response:
    # ignore_eos: a sampled EOS would end a request early, and "served in full" means
    # exactly max_tokens (a CI run once answered 200 with 11 of 16 tokens, sampled).
    body = {
        "model": MODEL,
        "prompt": "The capital of France is",
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    return httpx.post(stack.url + "/v1/completions", json=body, timeout=120)


def node_entry(stack: PDStack, node_id: str) -> dict | None:
    return next((n for n in stack.get("/health")[1]["nodes"] if n["id"] == node_id), None)


def dispatched_to(stack: PDStack, node_id: str) -> float:
    text = httpx.get(stack.url + "/metrics", timeout=10).text
    return metric(text, "pdserve:node_requests_total", node=node_id) or 0.0


def test_a_decode_pool_that_runs_out_preempts_and_recomputes_with_unchanged_answers(
    stack, smollm_llm
):
    # Four prompts of ~14 tokens growing by 40 need 16 blocks together: more than the 12 the
    # decode node has, though each fits alone. Out of blocks, the latest running sequence
    # gives its blocks back and is prefilled again later on the decode node.
    texts = [
        f"Write a list of {n} animals that live in the sea, one per line:" for n in (3, 5, 7, 9)
    ]
    prompts = [smollm_llm.tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [out.text for out in smollm_llm.generate(prompts, params)]

    def ask(prompt: list[int]) -> dict:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "ignore_eos": True,
                "temperature": 0}  # fmt: skip
        r = httpx.post(stack.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, prompts))
    assert [a["choices"][0]["text"] for a in answers] == expected
    assert stack.node("decode")["load"]["preemptions"] > 0
    stack.wait_for(
        lambda: (d := stack.node("decode")["load"])["used_blocks"] == 0 and d["reserved"] == 0,
        "the decode node to hold no blocks",
    )


def test_a_prefill_node_started_by_hand_registers_serves_and_drains_on_sigterm(
    stack, smollm_dir, tmp_path
):
    address = f"tcp://127.0.0.1:{stack.base + 50}"
    log = open(tmp_path / "manual-prefill.log", "w")
    node = subprocess.Popen(
        [sys.executable, "-m", "prefill_node", "--model", str(smollm_dir), "--device", "cpu",
         "--num-kv-blocks", "256",
         "--control-address", address, "--router-address", f"tcp://127.0.0.1:{stack.base}"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        stack.wait_for(
            lambda: (n := node_entry(stack, address)) is not None and n["healthy"],
            "the hand-started node to register",
            timeout_s=300,
        )
        assert [complete(stack).status_code for _ in range(2)] == [200, 200]
        assert dispatched_to(stack, address) >= 1  # round robin over both prefill nodes
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=60) == 0  # drained: idle, so it left after settling
        assert complete(stack).status_code == 200  # the seeded prefill node carries on
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
        log.close()


def test_sigterm_drains_the_decode_node_its_stream_finishes_and_it_comes_back(stack):
    old = stack.node("decode")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = []
    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", stack.url + "/v1/completions", json=body) as r,
    ):
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[len("data:") :]))
            if len(chunks) == 3:
                os.kill(old["pid"], signal.SIGTERM)
    *tokens, usage = chunks
    assert "error" not in tokens[-1] and "error" not in usage, chunks[-2:]
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["usage"]["completion_tokens"] == 48  # every token after the SIGTERM too
    stack.wait_for(
        lambda: (n := stack.node("decode"))["healthy"] and n["pid"] != old["pid"],
        "the launcher to restart the drained decode node",
        timeout_s=300,
    )
    assert complete(stack).status_code == 200


def test_a_prefill_node_killed_under_load_is_restarted_and_rejoins(stack):
    old = stack.node("prefill")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, stack, 16) for _ in range(8)]
        stack.wait_for(lambda: any(f.running() for f in futures), "requests in flight")
        os.kill(old["pid"], signal.SIGKILL)
        responses = [f.result() for f in futures]
    for r in responses:  # served in full, or an OpenAI error: never a hang or a broken body
        body = r.json()
        assert (r.status_code == 200 and body["usage"]["completion_tokens"] == 16) or (
            r.status_code >= 500 and body["error"]["message"]
        ), (r.status_code, body)
    stack.wait_for(
        lambda: (n := stack.node("prefill"))["healthy"] and n["pid"] != old["pid"],
        "the launcher to restart the killed prefill node",
        timeout_s=300,
    )
    before = dispatched_to(stack, old["id"])
    assert [complete(stack).status_code for _ in range(2)] == [200, 200]
    assert dispatched_to(stack, old["id"]) > before  # the restarted node takes traffic again
    stack.wait_for(
        lambda: (d := stack.node("decode")["load"])["used_blocks"] == 0 and d["reserved"] == 0,
        "the decode node to hold no blocks",
    )
