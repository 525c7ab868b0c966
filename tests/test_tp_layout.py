"""Which slice each tensor-parallel rank holds (`common.model.parallel`): pure arithmetic, no
processes. The layers that cut those slices out of checkpoint tensors: tests/test_linear_layers.py."""

from __future__ import annotations

import pytest

from common.model.parallel import TPLayout, rank_spec
from common.model.spec import ModelSpec, RopeSpec

SPEC = ModelSpec(
    architecture="LlamaForCausalLM", vocab_size=387, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
    rope=RopeSpec(theta=10000.0), max_position_embeddings=512, tie_word_embeddings=False,
    qkv_bias=True, qk_norm=False, sliding_window=None, eos_token_ids=(2,),
)  # fmt: skip


def test_kv_heads_are_split_then_replicated_when_fewer_than_ranks():
    two, four = TPLayout.of(SPEC, 2), TPLayout.of(SPEC, 4)
    assert [list(two.kv_heads(r)) for r in range(2)] == [[0], [1]]
    assert [list(four.kv_heads(r)) for r in range(4)] == [[0], [0], [1], [1]]
    assert four.kv_head_owners(1) == [2, 3]
    # every rank's query heads read the KV head it holds (GQA: 2 query heads per KV head)
    for r in range(4):
        assert {q // 2 for q in four.q_heads(r)} == set(four.kv_heads(r))


def test_layout_refuses_tp_sizes_the_model_cannot_split():
    with pytest.raises(ValueError, match="num_heads=4"):
        TPLayout.of(SPEC, 3)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        TPLayout(8, 24, 3, 128, 387)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        TPLayout.of(SPEC, 0)


def test_vocab_rows_cover_the_vocabulary_once_with_the_last_rank_padded():
    layout = TPLayout.of(SPEC, 4)
    rows = [list(layout.vocab(r)) for r in range(4)]
    assert sum(rows, []) == list(range(387))
    assert layout.vocab_per_rank == 97 and len(rows[-1]) == 96


def test_rank_spec_holds_one_ranks_heads_and_mlp_slice_and_the_whole_vocabulary():
    spec = rank_spec(SPEC, TPLayout.of(SPEC, 4))
    assert (spec.num_heads, spec.num_kv_heads, spec.intermediate_size) == (1, 1, 32)
    assert spec.vocab_size == 387 and spec.head_dim == 16
    assert rank_spec(SPEC, TPLayout.of(SPEC, 1)) is SPEC
