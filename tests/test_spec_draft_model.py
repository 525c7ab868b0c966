"""The draft-model proposer on CPU: with the target as its own draft it drafts exactly the
target's greedy continuation (across verify steps that accept some, all or none of the drafts,
and after a preemption); another tiny random draft drafts valid ids; a draft whose token ids
could mean other tokens is refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from common import LLM, SamplingParams
from common.engine.config import SpeculativeConfig
from common.engine.scheduler import ScheduledBatch, ScheduledSeq
from common.engine.sequence import Sequence
from common.engine.spec_decode.draft_model import DraftModelProposer, check_draft_vocabulary
from common.model.attention import create_backend
from common.model.source import read_spec, resolve_model

VOCAB = 384
BLOCK = 16
K = 4
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.25,
    tie_word_embeddings=False,
)


def save_llama(folder, seed: int, vocab: int = VOCAB, layers: int = 2, **extra):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, num_hidden_layers=layers, **COMMON, **extra)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("target"), seed=0)


def proposer(target_dir, draft_dir, num_blocks: int = 64) -> DraftModelProposer:
    target = resolve_model(str(target_dir))
    return DraftModelProposer.build(
        SpeculativeConfig("draft", K, str(draft_dir)),
        target,
        read_spec(target),
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_model_len=512,
        device=torch.device("cpu"),
        dtype=torch.float32,
        backend=create_backend("torch"),
    )


def decode_item(seq: Sequence) -> ScheduledBatch:
    """The decode step of `seq` as the scheduler gives it: its last token, not yet computed."""
    seq.num_computed_tokens = seq.num_tokens - 1
    return ScheduledBatch([ScheduledSeq(seq, seq.num_computed_tokens, 1)])


def sequence(request_id: str, prompt: list[int], output: list[int], blocks: range) -> Sequence:
    seq = Sequence(request_id, prompt, SamplingParams(temperature=0))
    seq.output_token_ids = list(output)
    seq.block_ids = list(blocks)
    return seq


def prompt_of(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


def test_target_as_its_own_draft_drafts_the_greedy_continuation(target_dir):
    prompts = [prompt_of(21, seed=1), prompt_of(7, seed=2)]
    with LLM(str(target_dir), device="cpu", block_size=BLOCK) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        expected = [o.token_ids for o in llm.generate(prompts, greedy)]
    draft = proposer(target_dir, target_dir)
    # Two sequences in disjoint blocks; each verify step keeps `accepted` drafts plus one token.
    seqs = [
        sequence("a", prompts[0], expected[0][:1], range(0, 8)),
        sequence("b", prompts[1], expected[1][:1], range(8, 16)),
    ]
    for accepted in (2, 4, 0, 1, 3):
        batch = decode_item(seqs[0])
        batch.items.append(decode_item(seqs[1]).items[0])
        got = draft.propose(batch, [K, K - 1]).token_ids
        for seq, drafts, limit, want in zip(seqs, got, (K, K - 1), expected, strict=True):
            n = len(seq.output_token_ids)
            assert drafts == want[n : n + limit]
            seq.output_token_ids = want[: n + min(accepted, limit) + 1]
    # A preempted sequence's blocks are new: the draft recomputes it from position 0.
    seqs[0].num_preemptions, seqs[0].block_ids = 1, list(range(16, 24))
    n = len(seqs[0].output_token_ids)
    assert draft.propose(decode_item(seqs[0]), [K]).token_ids == [expected[0][n : n + K]]


def test_other_draft_model_drafts_valid_ids_up_to_each_limit(target_dir, tmp_path):
    draft_dir = save_llama(tmp_path / "draft", seed=5, vocab=VOCAB - 84, layers=1)
    draft = proposer(target_dir, draft_dir)
    batch = decode_item(sequence("a", prompt_of(30, seed=3), [5], range(0, 4)))
    batch.items.append(
        decode_item(sequence("b", prompt_of(3, seed=4), [6, 7], range(4, 6))).items[0]
    )
    got = draft.propose(batch, [K, 0]).token_ids
    assert len(got[0]) == K and got[1] == []
    assert all(0 <= t < VOCAB - 84 for t in got[0])


def test_a_sequence_without_blocks_for_its_drafts_is_refused(target_dir):
    draft = proposer(target_dir, target_dir)
    seq = sequence("a", prompt_of(30, seed=3), [5], range(0, 2))  # 32 slots for 31 + 4 tokens
    with pytest.raises(ValueError, match="needs 3 blocks; it holds 2"):
        draft.propose(decode_item(seq), [K])


def test_draft_with_a_larger_vocabulary_is_refused(target_dir, tmp_path):
    draft_dir = save_llama(tmp_path / "draft", seed=5, vocab=VOCAB + 1, layers=1)
    with pytest.raises(ValueError, match=f"vocab_size {VOCAB + 1}.*target.*{VOCAB}"):
        proposer(target_dir, draft_dir)


def test_draft_with_other_eos_ids_is_refused(target_dir, tmp_path):
    draft_dir = save_llama(tmp_path / "draft", seed=5, layers=1, eos_token_id=7)
    (draft_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    with pytest.raises(ValueError, match=r"EOS ids \[7\], the target .* \[2\]"):
        proposer(target_dir, draft_dir)


def test_draft_with_another_tokenizer_is_refused(target_dir, tmp_path):
    target_copy = tmp_path / "target"
    shutil.copytree(target_dir, target_copy)
    draft_dir = save_llama(tmp_path / "draft", seed=5, layers=1)
    (target_copy / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (draft_dir / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')
    target, draft = resolve_model(str(target_copy)), resolve_model(str(draft_dir))
    with pytest.raises(ValueError, match="draft tokenizer .* differs from the target's"):
        check_draft_vocabulary(read_spec(draft), draft.directory, read_spec(target), target_copy)
    (draft_dir / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    check_draft_vocabulary(read_spec(draft), draft.directory, read_spec(target), target_copy)
