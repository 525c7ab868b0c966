"""Speculative decoding in the engine loop (CPU): greedy output is exactly the output without
speculation, through the offline LLM, with and without the decode-graph path, under a pool
small enough to preempt, with stop ids and max_tokens falling inside accepted runs; no block
is left behind. A tiny random Qwen2 (float32) whose greedy output repeats itself, so n-gram
lookup drafts and the target accepts some of it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from common import LLM, SamplingParams
from common.engine.spec_decode.ngram import lookup
from common.engine.spec_decode.proposer import Drafts
from tests.tiny_models import TINY_SHAPE

VOCAB = 384


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        **TINY_SHAPE,
        max_position_embeddings=512,
        initializer_range=0.25,
        tie_word_embeddings=False,
    )
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp("spec-qwen2")
    hf.save_pretrained(folder)
    return str(folder)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for n in (1, 9, 16, 40, 100):
        base = torch.randint(3, VOCAB, (max(1, n // 3),), generator=g).tolist()
        out.append((base * 4)[:n])  # repeated text: something for the lookup to find
    return out


def engine(folder: str, graphs: bool = False, **options) -> LLM:
    llm = LLM(
        folder,
        device="cpu",
        max_num_seqs=8,
        kv_cache_memory_bytes=options.pop("kv_bytes", 32 << 20),
        **options,
    )
    if graphs:  # on CPU: the graph code path, replayed eagerly
        worker = llm.engine.worker
        worker.runner.capture_graphs(worker._decode_graph_rows(), llm.engine.runtime.max_model_len)
    return llm


def spec(**extra) -> dict:
    return {"speculative_method": "ngram", "num_speculative_tokens": 4, **extra}


def run(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate(prompts(), params)
    allocator = llm.engine.worker.allocator
    assert allocator.num_available == allocator.num_blocks, "a block was left behind"
    assert not llm.engine.scheduler.has_work()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("graphs", [False, True])
def test_greedy_ngram_speculation_gives_exactly_the_tokens_without_it(model, graphs):
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2, 7, 30, 45)
    ]
    plain = run(engine(model), params)
    llm = engine(model, graphs, **spec())
    assert run(llm, params) == plain
    # Random weights rarely repeat the prompt: the lookup drafts, the target rejects.
    assert llm.engine.scheduler.spec_totals.num_draft_tokens > 0


class OracleProposer:
    """Drafts the reference (non-speculative) continuation, every `wrong_every`-th drafted
    token replaced by a wrong one: accepted runs of known length, and rejections mid-run."""

    method = "oracle"

    def __init__(self, reference: dict[tuple[int, ...], list[int]], wrong_every: int) -> None:
        self.reference, self.wrong_every = reference, wrong_every
        self.drafted = 0

    def propose(self, batch, limits):
        drafts = []
        for item, k in zip(batch.items, limits, strict=True):
            seq = item.seq
            ref = self.reference[tuple(seq.prompt_token_ids)]
            n = len(seq.output_token_ids)
            draft = []
            for t in ref[n : n + k]:
                self.drafted += 1
                draft.append((t + 1) % VOCAB if self.drafted % self.wrong_every == 0 else t)
            drafts.append(draft)
        return Drafts(drafts)

    def release(self, request_id: str) -> None:
        pass


@pytest.mark.parametrize("graphs", [False, True])
def test_accepted_runs_and_rejections_mid_run_give_exactly_the_reference(model, graphs):
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2, 7, 30, 45)
    ]
    plain = run(engine(model), params)
    llm = engine(model, graphs, **spec())
    reference = {tuple(p): out for p, out in zip(prompts(), plain, strict=True)}
    llm.engine.core.proposer = OracleProposer(reference, wrong_every=3)
    assert run(llm, params) == plain
    totals = llm.engine.scheduler.spec_totals
    assert totals.num_accepted_tokens > 0
    assert totals.num_accepted_tokens < totals.num_draft_tokens  # some were wrong
    assert totals.mean_accepted_length > 1.5


def test_stop_ids_and_max_tokens_inside_accepted_runs(model):
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = run(engine(model), [base] * 5)
    # Stop on a token that appears late in each output: with speculation it is often emitted
    # inside a run of accepted drafts, and the tokens after it must not be kept.
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=40,
            ignore_eos=True,
            stop_token_ids=[out[min(len(out) - 1, 25)]],
        )
        for out in plain
    ]
    expect = run(engine(model), params)
    assert run(engine(model, **spec()), params) == expect
    for out, full in zip(expect, plain, strict=True):
        assert out == full[: len(out)]


def test_a_pool_small_enough_to_preempt_gives_the_same_tokens(model):
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)] * 5
    plain = run(engine(model), params)
    llm = engine(model, **spec(), num_kv_blocks=24)
    assert run(llm, params) == plain
    assert llm.engine.scheduler.num_preemptions > 0


def test_speculation_switches_off_above_the_batch_limit(model):
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 5
    llm = engine(model, **spec(speculative_max_batch=2))
    plain = run(engine(model), params)
    assert run(llm, params) == plain
    llm_one = engine(model, **spec(speculative_max_batch=1))
    # Five requests run together: only the last one, once alone, could speculate.
    run(llm_one, [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)] * 5)
    assert llm_one.engine.scheduler.spec_totals.num_drafts == 0


def test_lookup_takes_the_longest_recurring_suffix_and_its_latest_occurrence():
    import numpy as np

    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    # Suffix [2, 3] last occurred at 5..6 (then 7, 5, 2); [5, 2, 3] never recurs.
    assert lookup(tokens, 1, 3, 3) == [7, 5, 2]
    assert lookup(tokens, 1, 3, 1) == [7]
    assert lookup(np.array([4, 5, 6]), 1, 3, 2) == []
    assert lookup(np.array([4]), 1, 3, 2) == []
    # min_n: a single-token suffix may match only when min_n is 1.
    assert lookup(np.array([8, 1, 9, 1]), 1, 2, 2) == [9, 1]
    assert lookup(np.array([8, 1, 9, 1]), 2, 2, 2) == []


def test_a_draft_model_equal_to_the_target_has_every_draft_accepted(model):
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 30, 1, 9, 17)
    ]
    plain = run(engine(model), params)
    llm = engine(model, **spec(speculative_method="draft", speculative_model=model))
    assert run(llm, params) == plain
    totals = llm.engine.scheduler.spec_totals
    assert totals.num_accepted_tokens == totals.num_draft_tokens > 0
    # Proposer pool and target pool share the blocks: the budget paid for both.
    plain_blocks = engine(model).engine.worker.allocator.num_blocks
    assert llm.engine.worker.allocator.num_blocks < plain_blocks


def test_eagle3_head_drafts_and_greedy_output_is_unchanged(tmp_path):
    from transformers import LlamaConfig

    from tests.test_spec_eagle3 import EPS, HEADS, INTER, KV_HEADS, TARGET_LAYERS, H, write_head
    from tests.test_spec_eagle3 import VOCAB as EAGLE_VOCAB

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=EAGLE_VOCAB,
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=512,
        initializer_range=0.25,
        rms_norm_eps=EPS,
    )
    target = tmp_path / "target"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(target)
    write_head(tmp_path / "head")
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (2, 25, 1, 7, 12)
    ]
    plain = run(engine(str(target)), params)
    for graphs in (False, True):
        llm = engine(
            str(target),
            graphs,
            **spec(speculative_method="eagle3", speculative_model=str(tmp_path / "head")),
        )
        assert run(llm, params) == plain
        assert llm.engine.scheduler.spec_totals.num_draft_tokens > 0
        # Colocated, every prompt row went through the target here: the head saw them all.
        assert llm.engine.core.proposer.num_unobserved_rows == 0


def test_above_the_batch_limit_the_loop_overlaps_again(model):
    llm = engine(model, **spec(speculative_max_batch=2))
    scheduler = llm.engine.scheduler
    for i, p in enumerate(prompts()):
        llm.engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=6))
    assert not scheduler.may_speculate()  # nothing runs yet: the prompts' step overlaps
    llm.engine.step()
    assert len(scheduler.running) == 5 and not scheduler.may_speculate()
    assert not llm.engine.core._needs_host_tokens()
