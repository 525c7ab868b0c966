"""PD through launch_pd.sh with `--transport nixl`: the prefill node WRITEs each prompt's KV
into the decode node's pool through NIXL (UCX; on a CPU its shared-memory or TCP path), and
the text is the single-process engine's. Skipped, with the reason, where nixl cannot run."""

from __future__ import annotations

import pytest
from openai import OpenAI

from common import SamplingParams
from common.text.tokenizer import apply_chat_template
from tests.pd_stack import PDStack
from tests.test_kv_transfer_nixl import needs_nixl

pytestmark = needs_nixl


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = PDStack(
        "--transport", "nixl", "--num-kv-blocks", "128",
        log_path=tmp_path_factory.mktemp("pd_nixl") / "launch.log",
    )  # fmt: skip
    yield s
    assert s.stop() == [], "processes left after Ctrl-C"


def test_nixl_writes_the_kv_and_pd_text_equals_the_single_process_engine(stack, smollm_llm):
    client = OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Name three primary colors."}]
    ids = apply_chat_template(smollm_llm.tokenizer, messages)
    local = smollm_llm.generate(ids, SamplingParams(temperature=0, max_tokens=12))[0]
    remote = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=12
    )
    assert remote.choices[0].message.content == local.text
    assert remote.model_extra["timing"]["kv_transfer"] >= 0
    log = stack.log_path.read_text()
    assert "is written into its pool by NIXL" in log and "goes as frames" not in log
    decode = stack.wait_for(
        lambda: (n := stack.node("decode"))["load"].get("kv_transfer_bytes") and n,
        "the decode node's KV byte count",
    )
    assert decode["load"]["kv_transfer_bytes"] > 0
