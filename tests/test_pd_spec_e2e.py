"""Speculative decoding across the prefill/decode split, end to end: real processes
(`scripts/launch_pd.sh`: router, prefill node, decode node), real HTTP, the embedded model.

A PD stack speculating with n-gram lookup (K = 4 on the decode pool, 3 on the prefill pool,
which never drafts) gives the tokens of a colocated node speculating the same way, and greedy
the tokens of the engine without speculation. The prompts ask the model to copy text, so the
lookup drafts and the target accepts: stop strings and max_tokens then fall inside accepted
runs, and a grammar masks drafted positions. Whatever ends a request, the decode node holds no
block afterwards.

The draft method runs on real nodes in this process (a tiny random target, tiny drafts written
here): the prefill node ships only the target's KV and the decode node computes the draft's.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from common import SamplingParams
from common.text.tokenizer import apply_chat_template
from tests.node_harness import engine_config, save_tiny_model
from tests.pd_stack import PDStack
from tests.test_spec_endings import Nodes, Stream, speculating
from tests.tiny_models import TINY_SHAPE

MODEL = "SmolLM2-135M-Instruct"
TEXT = (
    "The quick brown fox jumps over the lazy dog. "
    "A journey of a thousand miles begins with a single step."
)
COPY = f"Repeat this text exactly: {TEXT}"
CODE = "Copy this code:\ndef add(a, b):\n    return a + b\n\nprint(add(2, 3))"
QUESTION = "What is the capital of France?"
NGRAM = ("--speculative-method", "ngram")
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The stacks' processes share the cores with this one: more than one thread each
    oversubscribes them, and a spinning thread pool then slows everything tenfold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


STACKS = {
    "pd": (*NGRAM, "--decode-num-speculative-tokens", "4", "--prefill-num-speculative-tokens", "3"),
    "colocated": ("--colocated", *NGRAM, "--num-speculative-tokens", "4"),
}


@pytest.fixture(scope="module")
def stacks(tmp_path_factory) -> dict[str, PDStack]:
    """Both stacks, started side by side (a start mostly waits on model loads)."""
    folder = tmp_path_factory.mktemp("spec-stacks")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # see one_thread
    with ThreadPoolExecutor(len(STACKS)) as pool:
        starts = {
            name: pool.submit(PDStack, *flags, log_path=folder / f"{name}.log", env=env)
            for name, flags in STACKS.items()
        }
    started = {name: f.result() for name, f in starts.items() if f.exception() is None}
    try:
        for f in starts.values():
            f.result()  # the first start that failed raises here
        yield started
    finally:
        left = [pid for stack in started.values() for pid in stack.stop()]
        assert left == [], "processes left after Ctrl-C"


@pytest.fixture(scope="module")
def pd(stacks) -> PDStack:
    return stacks["pd"]


@pytest.fixture(scope="module")
def colocated(stacks) -> PDStack:
    return stacks["colocated"]


def chat(stack: PDStack, content: str, **body) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **body}
    reply = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def text(reply: dict, index: int = 0) -> str:
    return reply["choices"][index]["message"]["content"]


def unspeculated(llm, content: str, **params) -> str:
    """The engine's text without speculation (one process, the router's chat template)."""
    ids = apply_chat_template(llm.tokenizer, [{"role": "user", "content": content}])
    return llm.generate(ids, SamplingParams(**params))[0].text


def decode_pool_empty(stack: PDStack) -> None:
    """Wait for the decode node's heartbeat to show no block held and nothing running (the
    load it carries lags by up to one beat)."""
    stack.wait_for(
        lambda: (d := stack.node("decode")["load"])["used_blocks"] == 0 and d["running"] == 0,
        "the decode node to hold no block",
    )


@pytest.mark.parametrize(
    "content, max_tokens",
    [(COPY, 40), (COPY, 10), (CODE, 24), (QUESTION, 16)],
    ids=["copy", "max-tokens-inside-a-run", "code", "question"],
)
def test_pd_speculating_greedy_equals_colocated_speculating_and_no_speculation(
    pd, colocated, smollm_llm, content, max_tokens
):
    local = unspeculated(smollm_llm, content, temperature=0, max_tokens=max_tokens)
    remote = chat(pd, content, temperature=0, max_tokens=max_tokens)
    together = chat(colocated, content, temperature=0, max_tokens=max_tokens)
    assert text(remote) == text(together) == local
    # The decode node drafts from the prompt and the prefill node's first token exactly as the
    # colocated node drafts after its own prefill step: same drafts, same acceptances.
    counts = remote["timing"]["spec_decode"]
    assert counts == together["timing"]["spec_decode"]
    assert counts["num_drafts"] > 0
    if content == COPY:
        assert counts["mean_accepted_length"] >= 3.0, counts
        if max_tokens == 10:  # 1 first token, then runs of up to 5: the 10th ends a run early
            assert remote["usage"]["completion_tokens"] == 10
            assert remote["choices"][0]["finish_reason"] == "length"


def test_pd_speculating_seeded_sampling_equals_colocated_speculating(pd, colocated):
    """The prefill node draws the first token, the decode node verifies the rest; every draw
    is keyed by the request's seed (plus the sample's index) and its position, so both stacks
    draw the same tokens, for each of n samples."""
    knobs = dict(temperature=0.8, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    for content, n in ((COPY, 2), (QUESTION, 1)):
        remote = chat(pd, content, n=n, **knobs)
        together = chat(colocated, content, n=n, **knobs)
        texts = [text(remote, i) for i in range(n)]
        assert texts == [text(together, i) for i in range(n)]
        assert remote["timing"]["spec_decode"] == together["timing"]["spec_decode"]
        assert remote["usage"]["completion_tokens"] == 24 * n
        assert remote["timing"]["spec_decode"]["num_drafts"] > 0


def test_n_greedy_samples_each_equal_the_unspeculated_text(pd, smollm_llm):
    local = unspeculated(smollm_llm, COPY, temperature=0, max_tokens=24)
    reply = chat(pd, COPY, temperature=0, max_tokens=24, n=2)
    assert [text(reply, 0), text(reply, 1)] == [local, local]
    decode_pool_empty(pd)


def test_a_stop_string_inside_an_accepted_run_cuts_the_text_and_frees_the_blocks(pd):
    full = text(chat(pd, COPY, temperature=0, max_tokens=40))
    assert "journey" in full
    expected = full[: full.index("journey")]
    cut = chat(pd, COPY, temperature=0, max_tokens=40, stop=["journey"])
    assert text(cut) == expected and cut["choices"][0]["finish_reason"] == "stop"
    body = {"model": MODEL, "messages": [{"role": "user", "content": COPY}], "temperature": 0,
            "max_tokens": 40, "stop": ["journey"], "stream": True}  # fmt: skip
    with httpx.stream("POST", pd.url + "/v1/chat/completions", json=body, timeout=120) as r:
        chunks = [
            json.loads(line[len("data: ") :])
            for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == expected
    decode_pool_empty(pd)


def test_a_json_schema_with_speculation_gives_the_unspeculated_json(pd, smollm_llm):
    content = 'Return this JSON exactly: {"name": "Ada Lovelace", "age": 36}'
    structured = {"type": "json_schema", "schema": json.dumps(SCHEMA)}
    local = unspeculated(smollm_llm, content, temperature=0, max_tokens=40, structured=structured)
    reply = chat(
        pd, content, temperature=0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    )  # fmt: skip
    assert text(reply) == local
    assert json.loads(local)["name"] == "Ada Lovelace"
    assert reply["timing"]["spec_decode"]["num_accepted_tokens"] > 0


def test_client_disconnect_mid_stream_while_speculating_frees_the_decode_nodes_blocks(pd):
    body = {"model": MODEL, "messages": [{"role": "user", "content": COPY}], "max_tokens": 2000,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", pd.url + "/v1/chat/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        received = [line for line, _ in zip(lines, range(12), strict=False) if line]
        assert any(line.startswith("data:") for line in received)
    decode_pool_empty(pd)
    assert pd.node("prefill")["load"]["running"] == 0


# -- the draft method: real nodes in this process (tests/test_spec_endings.py's `Nodes`) -----


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("draft-target"))


def save_draft(folder, seed: int) -> str:
    """A tiny random draft with the target's vocabulary (and EOS ids), one layer."""
    torch.manual_seed(seed)
    shape = {**TINY_SHAPE, "num_hidden_layers": 1}
    config = Qwen2Config(vocab_size=256, max_position_embeddings=256, **shape)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return str(folder)


def serve_all(nodes: Nodes, params: SamplingParams) -> dict[tuple[str, int], Stream]:
    try:
        for rid, prompt in DRAFT_PROMPTS.items():
            nodes.send(rid, prompt, params)
        nodes.run()
        assert not nodes.errors, nodes.errors
        nodes.assert_nothing_held()
        return nodes.streams
    finally:
        nodes.close()


DRAFT_PROMPTS = {"a": list(range(10, 50)), "b": [7, 3, 9, 200, 41] * 5, "c": [5, 6]}


@pytest.mark.parametrize("draft", ["target-copy", "other"])
def test_pd_with_a_draft_model_gives_the_unspeculated_greedy_tokens(target_dir, tmp_path, draft):
    """The prefill node ships the target's KV only; the decode node computes the draft's prompt
    KV itself on a request's first verify step. With the target's own weights as the draft, its
    drafts are the target's greedy tokens, so they are all accepted only if that prompt KV is
    right; another random draft is mostly rejected. Either way the tokens are the unspeculated
    ones, as on a colocated node drafting the same way."""
    draft_dir = tmp_path / draft
    if draft == "target-copy":
        shutil.copytree(target_dir, draft_dir)
    else:
        save_draft(draft_dir, seed=1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = engine_config(target_dir)
    spec = speculating(plain, speculative_method="draft", speculative_model=str(draft_dir))
    want = serve_all(Nodes(tmp_path, "plain", plain, pd=False), params)
    pd_streams = serve_all(Nodes(tmp_path, "pd", spec, pd=True), params)
    colocated_streams = serve_all(Nodes(tmp_path, "colocated", spec, pd=False), params)
    for key, stream in want.items():
        assert pd_streams[key].token_ids == stream.token_ids, key
        assert colocated_streams[key].spec_decode == pd_streams[key].spec_decode, key
    counts = [pd_streams[rid, 0].spec_decode for rid in DRAFT_PROMPTS]
    assert all(c["num_drafts"] > 0 for c in counts), counts
    if draft == "target-copy":
        assert all(c["num_accepted_tokens"] == c["num_draft_tokens"] for c in counts), counts
