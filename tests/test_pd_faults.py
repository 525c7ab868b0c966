"""Faults and modes of the real stack: a node killed mid-stream, failing KV transfers, and the
colocated baseline. Each test starts its own stack through scripts/launch_pd.sh."""

from __future__ import annotations

import os
import signal
import threading

import httpx
from openai import OpenAI

from common import SamplingParams
from common.text.tokenizer import apply_chat_template
from tests.pd_stack import PDStack, alive

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_killing_the_decode_node_mid_stream_ends_the_stream_with_an_error(tmp_path):
    stack = PDStack("--router-heartbeat-timeout", "2", log_path=tmp_path / "launch.log")
    try:
        decode_pid = stack.node("decode")["pid"]
        body = {
            "model": MODEL,
            "messages": QUESTION,
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }
        events = []
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", stack.url + "/v1/chat/completions", json=body) as r,
        ):
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                events.append(line)
                if len(events) == 5:
                    os.kill(decode_pid, signal.SIGKILL)
        assert any('"error"' in e for e in events[5:]), events[-3:]
        status, health = stack.wait_for(
            lambda: (h := stack.get("/health"))[0] == 503 and h,
            "health to report the dead decode node",
        )
        decode = next(n for n in health["nodes"] if n["role"] == "decode")
        assert decode["healthy"] is False
        r = httpx.post(
            stack.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30
        )
        assert r.status_code == 503 and r.json()["error"]["message"]
    finally:
        assert stack.stop() == []
    assert not alive(decode_pid)


def test_failed_kv_transfers_end_requests_with_errors_and_free_blocks_on_both_sides(tmp_path):
    stack = PDStack("--prefill-fail-transfer-rate", "1.0", log_path=tmp_path / "launch.log")
    try:
        for _ in range(3):
            r = httpx.post(
                stack.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": QUESTION},
                timeout=60,
            )
            assert r.status_code >= 500 and "transfer" in r.json()["error"]["message"]
        # Heartbeat load lags by up to one beat: wait for both sides to report the end state.
        stack.wait_for(
            lambda: (
                stack.node("decode")["load"]["used_blocks"] == 0
                and stack.node("decode")["load"]["reserved"] == 0
                and stack.node("prefill")["load"]["transferring"] == 0
            ),
            "reservations and transfers to be released on both nodes",
        )
        assert stack.get("/health")[0] == 200
    finally:
        assert stack.stop() == []


def test_colocated_mode_gives_the_same_greedy_text_as_the_engine(tmp_path, smollm_llm):
    stack = PDStack("--colocated", log_path=tmp_path / "launch.log")
    try:
        client = OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Name three primary colors."}]
        ids = apply_chat_template(smollm_llm.tokenizer, messages)
        local = smollm_llm.generate(ids, SamplingParams(temperature=0, max_tokens=40))[0].text
        resp = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=40
        )
        assert resp.choices[0].message.content == local
        assert [n["role"] for n in stack.get("/health")[1]["nodes"]] == ["colocated"]
        assert "prefill_compute" in resp.model_extra["timing"]
    finally:
        assert stack.stop() == []


def test_prefill_killed_mid_transfer_frees_the_reservation_and_the_other_prefill_serves(tmp_path):
    # Two prefill nodes; a 2048-token prompt runs as two chunks, and its KV streams to the decode
    # node layer by layer during the second one (seconds on a CPU, against heartbeats every
    # 0.5 s): kill the prefill node while it is transferring.
    stack = PDStack(
        "--num-prefill",
        "2",
        "--prefill-max-num-batched-tokens",
        "1024",
        "--router-heartbeat-timeout",
        "2",
        # A slow CPU takes seconds per 1024-token chunk, and the decode side's transfer
        # deadline counts from its reservation: keep it from failing the request first.
        "--prefill-transfer-deadline-s",
        "600",
        "--decode-transfer-deadline-s",
        "600",
        log_path=tmp_path / "launch.log",
    )
    try:
        result: dict = {}

        def long_request() -> None:
            body = {
                "model": MODEL,
                "prompt": [100 + i % 5000 for i in range(2048)],
                "max_tokens": 8,
            }
            r = httpx.post(stack.url + "/v1/completions", json=body, timeout=120)
            result["status"], result["body"] = r.status_code, r.json()

        thread = threading.Thread(target=long_request)
        thread.start()
        busy = stack.wait_for(
            lambda: next(
                (
                    n
                    for n in stack.get("/health")[1]["nodes"]
                    if n["role"] == "prefill" and n["load"].get("transferring", 0) > 0
                ),
                None,
            ),
            "a prefill node to be transferring",
            timeout_s=300,
        )
        os.kill(busy["pid"], signal.SIGKILL)
        thread.join(timeout=120)
        assert result["status"] >= 500 and result["body"]["error"]["message"]
        stack.wait_for(
            lambda: (d := stack.node("decode")["load"])["reserved"] == 0 and d["used_blocks"] == 0,
            "the decode node to drop the dead prefill's reservation",
        )
        assert stack.get("/health")[0] == 200  # one prefill node and the decode node remain
        r = httpx.post(
            stack.url + "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "The capital of France is",
                "max_tokens": 4,
                "temperature": 0,
            },
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
    finally:
        assert stack.stop() == []
    assert not alive(busy["pid"])
