"""Pools that speculate differently never exchange KV: the speculative method and the draft
model are part of a pool's `KVFormat` (K and the n-gram sizes are not), so the router pairs
only agreeing pools (else a 503 naming both) and a decode node refuses KV sent straight to it
by a prefill node of another setting, naming both and keeping no block on either node.

Nodes: real `PrefillNode` / `DecodeNode` on a tiny random Qwen2 (tests/node_harness.py) in this
process, and real node processes of `scripts/launch_pd.sh` (the embedded model).
"""

from __future__ import annotations

import dataclasses
import shutil

import httpx
import pytest

from common.engine.config import EngineConfig
from common.engine.kv_format import KVFormat, speculative_name
from common.engine.worker import Worker
from common.model.source import ModelSource
from common.protocol.messages import RequestError, TokenBatch
from common.protocol.sampling_params import SamplingParams
from decode_node.node import DecodeNode
from pdserve.launcher import node_summary
from pdserve.plan import NodeProcess
from prefill_node.node import PrefillNode
from tests.node_harness import engine_config, save_tiny_model
from tests.pd_stack import PDStack
from tests.test_kv_format_refusal import assert_no_block_held, close
from tests.test_kv_format_refusal import run_pair as refusal_pair

PROMPT = list(range(10, 50))
F32 = KVFormat(
    kv_dtype="float32",
    kv_scales="none",
    quantization="none",
    architecture="Qwen2ForCausalLM",
    num_layers=30,
    planes=2,
    num_kv_heads=3,
    head_dim=64,
    block_size=16,
)


def speculating(engine: EngineConfig, **options) -> EngineConfig:
    speculative = dataclasses.replace(engine.speculative, **options)
    return dataclasses.replace(engine, speculative=speculative)


# -- what a pool's speculative setting is ---------------------------------------------------------


def test_the_setting_names_the_method_and_a_draft_models_name_and_config_digest(tmp_path):
    assert speculative_name("none") == "none" and speculative_name("ngram") == "ngram"
    first, copy, other = (tmp_path / name for name in ("draft-a", "draft-b", "draft-c"))
    for folder, config in [
        (first, '{"hidden_size": 64, "num_hidden_layers": 2}'),
        (copy, '{\n  "num_hidden_layers": 2,\n  "hidden_size": 64\n}'),  # same, reformatted
        (other, '{"hidden_size": 64, "num_hidden_layers": 3}'),
    ]:
        folder.mkdir()
        (folder / "config.json").write_text(config)
    a = speculative_name("draft", ModelSource(first, "small"))
    assert a.startswith("draft:small config:") and len(a.split(":")[-1]) == 12
    assert speculative_name("draft", ModelSource(copy, "small")) == a
    assert speculative_name("draft", ModelSource(other, "small")) != a
    assert speculative_name("eagle3", ModelSource(first, "small")) == "eagle3" + a[len("draft") :]
    with pytest.raises(ValueError, match="'draft' needs its draft model"):
        speculative_name("draft")


def test_a_mismatch_and_a_description_name_the_speculative_setting_of_both_sides():
    ngram = dataclasses.replace(F32, speculative="ngram")
    assert ngram.mismatch(F32, ("prefill", "decode")) == (
        "speculative ngram (prefill) vs none (decode)"
    )
    assert ngram.describe().endswith("16-token blocks, speculative ngram")
    assert KVFormat.from_dict(ngram.to_dict()) == ngram


# -- real nodes in this process ---------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("spec-agreement-qwen2"))


def test_a_workers_format_carries_its_speculative_setting_without_k(model_dir, tmp_path):
    """A draft model named by its directory: the worker resolves it like --model."""
    draft = tmp_path / "tiny-draft"
    shutil.copytree(model_dir, draft)
    engine = speculating(
        engine_config(model_dir), speculative_method="draft", speculative_model=str(draft)
    )
    worker = Worker(engine)
    expected = speculative_name("draft", ModelSource(draft, "tiny-draft"))
    assert expected.startswith("draft:tiny-draft config:")
    assert worker.runtime.kv_format.speculative == expected
    assert worker.runtime.kv_format.mismatch(
        Worker(engine_config(model_dir)).runtime.kv_format
    ) == (f"speculative {expected} (this) vs none (other)")


def run_pair(
    tmp_path, name: str, prefill_engine: EngineConfig, decode_engine: EngineConfig
) -> tuple[list, DecodeNode, PrefillNode]:
    """`test_kv_format_refusal.run_pair` over zmq with one greedy request ignoring EOS."""
    sampling = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    return refusal_pair(tmp_path, name, prefill_engine, decode_engine, sampling=sampling)


def test_kv_of_a_prefill_node_speculating_otherwise_is_refused_and_no_node_keeps_a_block(
    model_dir, tmp_path
):
    plain = engine_config(model_dir)
    heard, decode_node, prefill_node = run_pair(
        tmp_path, "mismatch", speculating(plain, speculative_method="ngram"), plain
    )
    try:
        errors = [m for m in heard if isinstance(m, RequestError) and m.request_id == "r"]
        assert errors and all(e.status == 500 for e in errors), heard
        assert (
            "speculative ngram (prefill node, sender) vs none (decode node, receiver)"
            in errors[0].message
        )
        assert_no_block_held(decode_node, prefill_node)
        assert decode_node.stats["kv_transfer_failures"] == 1
    finally:
        close(decode_node, prefill_node)


def test_pools_of_one_method_with_different_k_exchange_kv(model_dir, tmp_path):
    plain = engine_config(model_dir)
    prefill = speculating(plain, speculative_method="ngram", num_speculative_tokens=2)
    decode = speculating(
        plain, speculative_method="ngram", num_speculative_tokens=5, speculative_ngram_max=3
    )
    heard, decode_node, prefill_node = run_pair(tmp_path, "k", prefill, decode)
    try:
        assert not [m for m in heard if isinstance(m, RequestError)], heard
        tokens = [t for m in heard if isinstance(m, TokenBatch) for t in m.token_ids.tolist()]
        assert len(tokens) == 3  # the decode node's share: max_tokens 4 less the first token
        assert_no_block_held(decode_node, prefill_node)
    finally:
        close(decode_node, prefill_node)


# -- real node processes behind the router ------------------------------------------------------


def chat(stack: PDStack) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Name three primary colors."}],
            "temperature": 0, "max_tokens": 8}  # fmt: skip
    return httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=120)


def test_the_router_refuses_pools_speculating_otherwise_naming_both(tmp_path):
    stack = PDStack("--prefill-speculative-method", "ngram", log_path=tmp_path / "launch.log")
    try:
        reply = chat(stack)
        assert reply.status_code == 503, reply.text
        message = reply.json()["error"]["message"]
        nodes = {n["role"]: n for n in stack.get("/health")[1]["nodes"]}
        assert nodes["prefill"]["id"] in message and nodes["decode"]["id"] in message
        assert "speculative ngram (prefill) vs none (decode)" in message
        for node in nodes.values():
            assert node["load"]["used_blocks"] == 0
    finally:
        assert stack.stop() == []


def test_the_router_pairs_pools_of_one_method_whatever_their_k(tmp_path):
    stack = PDStack(
        "--speculative-method", "ngram", "--prefill-num-speculative-tokens", "2",
        "--decode-num-speculative-tokens", "6", log_path=tmp_path / "launch.log",
    )  # fmt: skip
    try:
        formats = {n["role"]: n["info"]["kv_format"] for n in stack.get("/health")[1]["nodes"]}
        assert {f["speculative"] for f in formats.values()} == {"ngram"}
        summary = (tmp_path / "launch.log").read_text()
        assert "speculative ngram, K 2" in summary and "speculative ngram, K 6" in summary
        reply = chat(stack)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
    finally:
        assert stack.stop() == []


def test_the_launcher_summary_shows_each_pools_speculative_setting_and_k():
    info = {"num_kv_blocks": 64, "block_size": 16, "max_model_len": 512, "pid": 7,
            "device": "cpu", "dtype": "float32",
            "kv_format": dataclasses.replace(F32, speculative="ngram").to_dict()}  # fmt: skip
    node = NodeProcess("decode-0", "decode", "tcp://d", [], 1)
    assert node_summary(node, {"info": info}, 4).endswith("; speculative ngram, K 4")
    info["kv_format"] = F32.to_dict()
    assert node_summary(node, {"info": info}, 4).endswith("; speculative none")
