"""Sampler behaviour on CPU torch: filters, greedy, seeding, temperature, penalties, logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from common.sampler import (
    Sampler,
    SamplingInputs,
    apply_penalties,
    make_generator,
)
from common.sampling_params import SamplingParams

CPU = torch.device("cpu")
DRAWS = 2000


@pytest.fixture(autouse=True)
def _seed_default_rng() -> None:
    torch.manual_seed(0)


def make_inputs(
    params: list[SamplingParams],
    prompts: list[Sequence[int]] | None = None,
    outputs: list[Sequence[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    eos: list[Sequence[int]] | None = None,
) -> SamplingInputs:
    rows = len(params)
    return SamplingInputs(
        params=params,
        prompt_token_ids=prompts or [[] for _ in range(rows)],
        output_token_ids=outputs or [[] for _ in range(rows)],
        generators=generators or [None] * rows,
        eos_token_ids=eos or [[] for _ in range(rows)],
    )


def sample_many(row: list[float], params: SamplingParams, draws: int = DRAWS) -> set[int]:
    """Tokens emitted over `draws` copies of one logits row, sampled as one batch."""
    logits = torch.tensor([row]).repeat(draws, 1)
    return set(Sampler()(logits, make_inputs([params] * draws)).token_ids)


def log_probs(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


def test_top_k_emits_only_the_k_largest_logits() -> None:
    row = [0.0, 2.8, 1.0, 3.0, 2.0, 2.9, -1.0, 0.5]
    assert sample_many(row, SamplingParams(top_k=3)) == {3, 5, 1}


def test_top_p_emits_only_the_smallest_nucleus_reaching_p() -> None:
    row = log_probs([0.05, 0.3, 0.15, 0.5])
    # 0.5 alone is < 0.75, 0.5 + 0.3 reaches it: tokens 3 and 1 form the nucleus.
    assert sample_many(row, SamplingParams(top_p=0.75)) == {3, 1}


def test_top_p_always_keeps_the_most_likely_token() -> None:
    row = log_probs([0.2, 0.6, 0.2])
    assert sample_many(row, SamplingParams(top_p=0.01)) == {1}


def test_min_p_drops_tokens_below_fraction_of_max_prob() -> None:
    row = log_probs([0.1, 0.4, 0.2, 0.3])
    # Floor is 0.6 * 0.4 = 0.24.
    assert sample_many(row, SamplingParams(min_p=0.6)) == {1, 3}


def test_top_k_top_p_and_min_p_compose() -> None:
    row = log_probs([0.3, 0.05, 0.25, 0.2, 0.12, 0.08])
    # top_k=4 keeps {0, 2, 3, 4} (renormalized 0.34, 0.29, 0.23, 0.14); top_p=0.8 drops 4
    # (0.86 of mass is before it); min_p=0.7 then drops 3 (0.2 < 0.7 * 0.3).
    assert sample_many(row, SamplingParams(top_k=4, top_p=0.8, min_p=0.7)) == {0, 2}


def test_filters_apply_per_row_within_one_batch() -> None:
    logits = torch.tensor([log_probs([0.25, 0.25, 0.5])]).repeat(DRAWS, 1)
    params = [SamplingParams(top_k=1), SamplingParams()] * (DRAWS // 2)
    tokens = Sampler()(logits, make_inputs(params)).token_ids
    assert set(tokens[0::2]) == {2}
    assert set(tokens[1::2]) == {0, 1, 2}


def test_greedy_picks_argmax_of_logits() -> None:
    logits = torch.randn(8, 50)
    out = Sampler()(logits, make_inputs([SamplingParams(temperature=0.0)] * 8))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_batch_of_greedy_and_sampled_rows() -> None:
    logits = torch.randn(DRAWS, 6)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=2)] * (DRAWS // 2)
    tokens = Sampler()(logits, make_inputs(params)).token_ids
    assert tokens[0::2] == logits[0::2].argmax(dim=-1).tolist()
    top2 = logits[1::2].topk(2, dim=-1).indices.tolist()
    assert all(token in allowed for token, allowed in zip(tokens[1::2], top2, strict=True))
    # Sampled rows really sample: they do not all collapse to the argmax.
    assert tokens[1::2] != logits[1::2].argmax(dim=-1).tolist()


def run_seeded_steps(logits: torch.Tensor, row: int, seeds: list[int | None], steps: int) -> list:
    """Samples `steps` times with one generator per row kept across steps; returns row's tokens."""
    generators = [make_generator(seed, CPU) for seed in seeds]
    params = [SamplingParams(seed=seed) for seed in seeds]
    inputs = make_inputs(params, generators=generators)
    return [Sampler()(logits, inputs).token_ids[row] for _ in range(steps)]


def test_seeded_sampling_repeats_across_calls() -> None:
    logits = torch.randn(1, 1000)
    assert run_seeded_steps(logits, 0, [7], 8) == run_seeded_steps(logits, 0, [7], 8)


def test_seeded_row_gives_same_tokens_alone_and_in_a_mixed_batch() -> None:
    logits = torch.randn(16, 1000)
    seeds: list[int | None] = [None if i % 2 else 100 + i for i in range(16)]
    seeds[5] = 1234
    in_batch = run_seeded_steps(logits, 5, seeds, 8)
    alone = run_seeded_steps(logits[5:6], 0, [1234], 8)
    assert in_batch == alone


def test_different_seeds_give_different_tokens() -> None:
    logits = torch.zeros(1, 1000)
    assert run_seeded_steps(logits, 0, [1], 8) != run_seeded_steps(logits, 0, [2], 8)


def test_low_temperature_concentrates_mass_on_argmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]]).repeat(DRAWS, 1)

    def argmax_share(temperature: float) -> float:
        params = [SamplingParams(temperature=temperature)] * DRAWS
        tokens = Sampler()(logits, make_inputs(params)).token_ids
        return tokens.count(0) / DRAWS

    # At T=1 the argmax has probability e^2 / (e^2 + e + 1) ~ 0.67; at T=0.1 ~ 1 - 5e-5.
    assert argmax_share(1.0) < 0.8
    assert argmax_share(0.1) > 0.99


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[1.0, 2.0, -0.5, -1.0, 3.0, 0.0]])
    inputs = make_inputs(
        [SamplingParams(repetition_penalty=2.0)], prompts=[[1, 5]], outputs=[[3, 3]]
    )
    expected = torch.tensor([[1.0, 1.0, -0.5, -2.0, 3.0, 0.0]])
    assert torch.equal(apply_penalties(logits, inputs), expected)
    assert torch.equal(logits, torch.tensor([[1.0, 2.0, -0.5, -1.0, 3.0, 0.0]])), "input untouched"


def test_frequency_and_presence_penalties_subtract_count_terms() -> None:
    logits = torch.zeros(2, 8)
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
    ]
    # Prompt tokens do not count; row 1 has no output yet (padding must count nothing).
    inputs = make_inputs(params, prompts=[[7], [7]], outputs=[[2, 2, 5, 2], []])
    expected = torch.zeros(2, 8)
    expected[0, 2] = -(0.5 * 3 + 0.25)
    expected[0, 5] = -(0.5 * 1 + 0.25)
    assert torch.equal(apply_penalties(logits, inputs), expected)


def test_penalties_leave_rows_without_penalties_unchanged() -> None:
    logits = torch.randn(2, 8)
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0), SamplingParams()]
    inputs = make_inputs(params, prompts=[[1], [1]], outputs=[[2], [2]])
    assert torch.equal(apply_penalties(logits, inputs)[1], logits[1])


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[9.0, 1.0, 2.0, 0.0, 8.0]])
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4])
    early = make_inputs([params], outputs=[[1, 2]], eos=[[0]])
    masked = apply_penalties(logits, early)
    assert masked[0, 0] == -math.inf and masked[0, 4] == -math.inf
    assert Sampler()(logits, early).token_ids == [2]
    reached = make_inputs([params], outputs=[[1, 2, 3]], eos=[[0]])
    assert Sampler()(logits, reached).token_ids == [0]


def test_ignore_eos_leaves_eos_unmasked_during_min_tokens() -> None:
    logits = torch.tensor([[9.0, 1.0, 2.0]])
    params = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert Sampler()(logits, make_inputs([params], eos=[[0]])).token_ids == [0]


def test_logprobs_are_raw_log_softmax_and_top_n_sorted() -> None:
    logits = torch.randn(3, 30)
    params = [
        SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.8),
        SamplingParams(logprobs=0, temperature=0.0),
        SamplingParams(),
    ]
    out = Sampler()(logits, make_inputs(params, prompts=[[1, 2, 3]] * 3))
    raw = torch.log_softmax(logits, dim=-1)

    assert out.logprobs is not None and out.top_logprobs is not None
    for row, token in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(raw[row, token].item())
    top = out.top_logprobs[0]
    assert top is not None and len(top) == 5
    assert [t for t, _ in top] == raw[0].topk(5).indices.tolist()
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert [lp for _, lp in top] == pytest.approx(raw[0].topk(5).values.tolist())
    assert out.top_logprobs[1] == []
    assert out.top_logprobs[2] is None


def test_no_logprobs_requested_returns_none() -> None:
    out = Sampler()(torch.randn(2, 10), make_inputs([SamplingParams()] * 2))
    assert out.logprobs is None and out.top_logprobs is None


def test_make_generator_is_none_without_seed() -> None:
    assert make_generator(None, CPU) is None
    assert isinstance(make_generator(3, CPU), torch.Generator)


def test_row_count_mismatch_raises_value_error() -> None:
    with pytest.raises(ValueError, match="does not match"):
        Sampler()(torch.randn(3, 10), make_inputs([SamplingParams()] * 2))
