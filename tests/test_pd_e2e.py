"""The PD stack end to end: real processes (router, prefill node, decode node), real ZMQ
sockets and KV transfer, real HTTP through the official `openai` client, the embedded model."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from openai import OpenAI

from common import SamplingParams
from common.text.tokenizer import apply_chat_template
from router.timing import TTFT_PHASES
from tests.pd_stack import PDStack
from tests.router_fakes import metric

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = PDStack(log_path=tmp_path_factory.mktemp("pd") / "launch.log")
    yield s
    assert s.stop() == [], "processes left after Ctrl-C"


@pytest.fixture(scope="module")
def client(stack):
    return OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy_chat(client, messages, max_tokens=48, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **kw
    )


def test_chat_completion_non_streaming_answers_paris_with_usage_and_timing(client):
    resp = greedy_chat(client, QUESTION)
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens > 0 and resp.usage.prompt_tokens > 0
    timing = resp.model_extra["timing"]
    for phase in ("kv_transfer", "decode_admission_wait", "ttft", "decode_intervals"):
        assert phase in timing
    # Every TTFT phase is measured by one process (node_decode, router_encode included).
    assert all(timing[phase] >= 0 for phase in TTFT_PHASES if phase != "first_token_delivery")
    assert sum(timing[phase] for phase in TTFT_PHASES) == pytest.approx(timing["ttft"])


def test_chat_completion_streaming_equals_non_streaming(client):
    whole = greedy_chat(client, QUESTION).choices[0].message.content
    chunks = list(
        greedy_chat(client, QUESTION, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_text_completion_with_text_and_token_id_prompts(client, smollm_llm):
    prompt = "The capital of France is"
    ids = smollm_llm.tokenizer.encode(prompt)
    by_text = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=8)
    assert by_text.choices[0].text == by_ids.choices[0].text
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=8, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == by_text.choices[0].text


def test_pd_greedy_text_equals_single_process_engine(client, smollm_llm):
    for content in ("Write a haiku about autumn.", "Name three primary colors."):
        messages = [{"role": "user", "content": content}]
        ids = apply_chat_template(smollm_llm.tokenizer, messages)
        local = smollm_llm.generate(ids, SamplingParams(temperature=0, max_tokens=40))[0]
        remote = greedy_chat(client, messages, max_tokens=40).choices[0].message.content
        assert remote == local.text


def test_pd_seeded_sampling_equals_the_single_process_engine(client, smollm_llm):
    """The prefill node draws the first token, the decode node the rest (overlapped loop,
    penalties from on-device counts): the same text as one process drawing them all."""
    messages = [{"role": "user", "content": "Invent a name for a cat."}]
    ids = apply_chat_template(smollm_llm.tokenizer, messages)
    knobs = dict(temperature=0.9, top_p=0.9, seed=1234, frequency_penalty=0.5, max_tokens=20)
    local = smollm_llm.generate(ids, SamplingParams(**knobs, ignore_eos=True))[0]
    remote = client.chat.completions.create(
        model=MODEL, messages=messages, extra_body={"ignore_eos": True}, **knobs
    )
    assert remote.choices[0].message.content == local.text
    assert remote.usage.completion_tokens == 20


def test_16_concurrent_clients_each_get_the_text_of_a_lone_request(client):
    prompts = [
        [{"role": "user", "content": f"Tell me a fact about the number {i}."}] for i in range(16)
    ]
    alone = [greedy_chat(client, p, max_tokens=24).choices[0].message.content for p in prompts[:4]]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(
            pool.map(
                lambda p: greedy_chat(client, p, max_tokens=24).choices[0].message.content, prompts
            )
        )
    assert together[:4] == alone
    assert all(together)


def test_stop_string_ends_the_answer_without_leaking_it(client):
    full = greedy_chat(client, QUESTION).choices[0].message.content
    assert " is " in full
    cut = greedy_chat(client, QUESTION, stop=[" is "])
    assert cut.choices[0].message.content == full[: full.index(" is ")]
    assert cut.choices[0].finish_reason == "stop"
    streamed = greedy_chat(client, QUESTION, stop=[" is "], stream=True)
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        == full[: full.index(" is ")]
    )


def test_client_disconnect_mid_stream_frees_the_decode_nodes_blocks(stack):
    body = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", stack.url + "/v1/chat/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        received = [
            line for line, _ in zip(lines, range(20), strict=False) if line.startswith("data:")
        ]
        assert received
    # Heartbeats show the decode pool back to empty and nothing running on either node (the
    # load they carry lags by up to one beat, so wait for the end state).
    stack.wait_for(
        lambda: (
            (d := stack.node("decode")["load"])["used_blocks"] == 0
            and d["running"] == 0
            and stack.node("prefill")["load"]["running"] == 0
        ),
        "blocks to be freed after the disconnect",
    )


BAD_REQUESTS = {
    "malformed_json": ("/v1/chat/completions", b'{"model": "x", "messages": [', 400),
    "wrong_type": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": QUESTION, "max_tokens": "ten"},
        400,
    ),
    "empty_messages": ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    "prompt_too_long": ("/v1/completions", {"model": MODEL, "prompt": "hello " * 9000}, 400),
    "token_out_of_vocab": ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**7]}, 400),
    "absurd_max_tokens": (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 10**12},
        400,
    ),
    "negative_max_tokens": (
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": -5},
        400,
    ),
    "unknown_model": ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_gets_openai_error_and_server_keeps_serving(stack, client, case):
    path, body, status = BAD_REQUESTS[case]
    with httpx.Client(timeout=60) as http:
        if isinstance(body, bytes):
            r = http.post(
                stack.url + path, content=body, headers={"content-type": "application/json"}
            )
        else:
            r = http.post(stack.url + path, json=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["message"] and error["type"]
    assert "Paris" in greedy_chat(client, QUESTION, max_tokens=16).choices[0].message.content
    assert stack.get("/health")[0] == 200


def test_models_and_health_endpoints(stack):
    status, models = stack.get("/v1/models")
    assert status == 200 and models["data"][0]["id"] == MODEL
    status, health = stack.get("/health")
    assert status == 200
    assert sorted(n["role"] for n in health["nodes"]) == ["decode", "prefill"]
    assert all(n["healthy"] for n in health["nodes"])


def test_metrics_endpoint_counts_requests_and_reports_every_node(stack):
    text = httpx.get(stack.url + "/metrics", timeout=10).text
    assert metric(text, "pdserve:requests_total", model_name=MODEL, status="200") > 0
    assert metric(text, "pdserve:time_to_first_token_seconds_count", model_name=MODEL) > 0
    for role in ("prefill", "decode"):
        assert metric(text, "pdserve:node_healthy", role=role) == 1
        assert metric(text, "pdserve:kv_cache_usage_perc", role=role) is not None
    assert metric(text, "pdserve:prefix_cache_queries_total", role="prefill") > 0
    assert metric(text, "pdserve:kv_transfer_bytes_total", role="decode") > 0


@pytest.mark.parametrize(
    "stream_min_tokens", [0, 1024], ids=["layer-by-layer", "short-steps-in-one-send"]
)
def test_cuda_ipc_transport_on_cpu_falls_back_and_matches_the_engine_both_ways_of_shipping(
    tmp_path, smollm_llm, stream_min_tokens
):
    """On CPU the cuda_ipc sender falls back to frames (one warning). Its prompts (< 1024
    tokens) ship either per layer during the forward (min 0) or in one `send_layers` call after
    the first token (the default 1024): the text must equal the in-process engine's both ways."""
    log_path = tmp_path / "launch.log"
    s = PDStack(
        "--transport", "cuda_ipc", "--prefill-ipc-stream-min-tokens", str(stream_min_tokens),
        log_path=log_path,
    )  # fmt: skip
    try:
        client = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Name three primary colors."}]
        ids = apply_chat_template(smollm_llm.tokenizer, messages)
        local = smollm_llm.generate(ids, SamplingParams(temperature=0, max_tokens=24))[0]
        assert greedy_chat(client, messages, max_tokens=24).choices[0].message.content == local.text
    finally:
        assert s.stop() == [], "processes left after Ctrl-C"
    assert "goes as frames through host memory" in log_path.read_text()
