"""Tensor parallelism inside one process group of real rank processes (gloo, CPU, fp32):
greedy output at TP 2 and TP 4 equals TP 1 and HF transformers `generate()`.

The tiny Llama has 4 query heads and 2 KV heads, so TP 2 splits the KV heads and TP 4
replicates each on two ranks; its vocabulary (387) divides by neither, so the last rank's
embedding and LM head rows are padded. Each `LLM(tp=n)` starts n - 1 rank processes (rank 0
is this process), drives them step by step and stops them on `close()`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from common import LLM, SamplingParams
from tests.hf_oracle import hf_greedy
from tests.pd_stack import ROOT, alive, descendants
from tests.tiny_models import TINY_SHAPE

COMMON = dict(TINY_SHAPE, vocab_size=387, max_position_embeddings=512, initializer_range=0.25)
NEW_TOKENS = 10
OPTIONS = dict(device="cpu", block_size=16, max_num_batched_tokens=256, num_kv_blocks=64)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 387, (n,), generator=g).tolist() for n in (1, 17, 40)]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def generate(model: str, tp: int, **options) -> list[list[int]]:
    with LLM(model, tp=tp, **{**OPTIONS, **options}) as llm:
        return [out.token_ids for out in llm.generate(prompts(), greedy())]


def save(config, folder) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp_llama")
    hf = save(LlamaConfig(**COMMON, tie_word_embeddings=False), folder)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts()]
    return str(folder), expected


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_at_tp_n_equals_hf(llama, tp):
    """TP 4: two ranks hold each KV head; both decode steps and prefill chunks run sharded,
    and the overlapped loop fills placeholder tokens from the ids rank 0 broadcasts."""
    folder, expected = llama
    assert generate(folder, tp) == expected


def test_dummy_weights_of_qwen2_with_bias_and_tied_embeddings_at_tp2_equal_tp1(tmp_path):
    """Dummy weights are drawn at full size in single-rank order, then sharded (QKV bias
    split with the heads, the tied embedding and LM head cut alike); chunked prefill."""
    (tmp_path / "config.json").write_text(
        Qwen2Config(**COMMON, tie_word_embeddings=True).to_json_string()
    )
    options = dict(load_format="dummy", seed=7, max_num_batched_tokens=32)
    assert generate(str(tmp_path), 2, **options) == generate(str(tmp_path), 1, **options)


def test_tp_size_the_model_cannot_split_is_refused_before_any_rank_starts(llama):
    folder, _ = llama
    with pytest.raises(ValueError, match="tp=3 does not divide num_heads=4"):
        LLM(folder, tp=3, **OPTIONS)


FORGETFUL = """
from common import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM({folder!r}, tp=2, **{options!r})
    print(llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2))[0].token_ids)
"""


def is_spawned_rank(pid: int) -> bool:
    try:
        command = (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False
    return b"spawn_main" in command


def test_a_process_that_never_closes_its_llm_exits_cleanly_and_takes_its_ranks(llama, tmp_path):
    """Its ranks ignore SIGTERM and wait in a collective: the exit handler kills them."""
    folder, _ = llama
    script = tmp_path / "forgetful.py"
    script.write_text(FORGETFUL.format(folder=folder, options=OPTIONS))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE)
    ranks: list[int] = []  # not multiprocessing's resource tracker, which leaves on its own
    while proc.poll() is None and not ranks:
        ranks = [pid for pid in descendants(proc.pid) if is_spawned_rank(pid)]
        time.sleep(0.05)
    assert ranks, "the rank process was never seen"
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and out.strip().startswith(b"[")
    assert not any(alive(pid) for pid in ranks)


def test_speculative_verify_steps_at_tp2_equal_hf(llama):
    """Verify steps (several decode rows per sequence, more logits rows than sampled items)
    broadcast to the other rank; drafts accepted and rejected mid-run."""
    from tests.test_spec_decode_engine import OracleProposer

    folder, expected = llama
    spec = dict(speculative_method="ngram", num_speculative_tokens=3)
    with LLM(folder, tp=2, **OPTIONS, **spec) as llm:
        reference = {tuple(p): out for p, out in zip(prompts(), expected, strict=True)}
        llm.engine.core.proposer = OracleProposer(reference, wrong_every=3)
        assert [o.token_ids for o in llm.generate(prompts(), greedy())] == expected
        assert llm.engine.scheduler.spec_totals.num_accepted_tokens > 0


def test_a_draft_model_with_tensor_parallelism_is_refused(llama):
    folder, _ = llama
    with pytest.raises(ValueError, match="tp=2"):
        LLM(folder, tp=2, speculative_method="draft", speculative_model=folder, **OPTIONS)
