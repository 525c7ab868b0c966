"""FP8 KV end to end, real processes (`scripts/launch_pd.sh`), the embedded model. PD with an
FP8 KV cache gives the greedy text of a colocated stack with an FP8 KV cache: both quantize K
and V the same way, so the KV hop must be bit exact. A prefill pool whose KV format differs
from the decode pool's (its KV dtype, or the quantization that computes K and V) is refused by
the router (503 naming both nodes and what differs), and neither node holds a block.
"""

from __future__ import annotations

import httpx
import pytest

from tests.fp8_kv import needs_fp8_attention
from tests.pd_stack import PDStack

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["Write a haiku about autumn.", "Name three primary colors."]


def greedy(stack: PDStack, content: str) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 40,
    }
    return httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=120)


def kv_dtypes(stack: PDStack) -> dict[str, str]:
    return {n["role"]: n["info"]["kv_format"]["kv_dtype"] for n in stack.get("/health")[1]["nodes"]}


@needs_fp8_attention
def test_pd_with_an_fp8_kv_cache_gives_the_text_of_colocated_with_one(tmp_path):
    texts: dict[str, list[str]] = {}
    for name, flags in [("pd", ()), ("colocated", ("--colocated",))]:
        stack = PDStack(*flags, "--kv-cache-dtype", "fp8", log_path=tmp_path / f"{name}.log")
        try:
            assert set(kv_dtypes(stack).values()) == {"float8_e4m3fn"}
            replies = [greedy(stack, content) for content in PROMPTS]
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
            texts[name] = [r.json()["choices"][0]["message"]["content"] for r in replies]
        finally:
            assert stack.stop() == []
    assert all(texts["pd"]) and texts["pd"] == texts["colocated"]


MISMATCHES = [
    pytest.param(
        ("--prefill-kv-cache-dtype", "fp8"),
        "kv_dtype float8_e4m3fn (prefill) vs float32 (decode)",
        marks=needs_fp8_attention,
        id="kv_dtype",
    ),
    pytest.param(  # both pools float32: only the format tells the K and V apart
        ("--prefill-quantization", "fp8"),
        "quantization fp8 channel weights, token activations (prefill) vs none (decode)",
        id="quantization",
    ),
]


@pytest.mark.parametrize("flags, difference", MISMATCHES)
def test_a_prefill_pool_of_another_kv_format_is_refused_by_the_router_naming_both(
    tmp_path, flags, difference
):
    stack = PDStack(*flags, log_path=tmp_path / "launch.log")
    try:
        reply = greedy(stack, PROMPTS[0])
        assert reply.status_code == 503, reply.text
        message = reply.json()["error"]["message"]
        nodes = {n["role"]: n for n in stack.get("/health")[1]["nodes"]}
        assert nodes["prefill"]["id"] in message and nodes["decode"]["id"] in message
        assert difference in message
        for node in nodes.values():
            assert node["load"]["used_blocks"] == 0
        assert nodes["decode"]["load"]["reserved"] == 0
        assert nodes["prefill"]["load"]["transferring"] == 0
        assert (tmp_path / "launch.log").read_text().count("cannot exchange KV") == 1
    finally:
        assert stack.stop() == []
