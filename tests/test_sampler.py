"""Sampler behaviour on CPU torch: filters, greedy, seeding, temperature, penalties, logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from common.engine import sampling_ops as ops
from common.engine.sampler import Sampler, SamplingInputs
from common.engine.token_counts import TokenCounts
from common.protocol.sampling_params import SamplingParams

CPU = torch.device("cpu")
DRAWS = 2000


@pytest.fixture(autouse=True)
def _seed_default_rng() -> None:
    torch.manual_seed(0)


def make_inputs(
    params: list[SamplingParams],
    prompts: list[Sequence[int]] | None = None,
    outputs: list[Sequence[int]] | None = None,
    eos: list[Sequence[int]] | None = None,
    request_ids: list[str] | None = None,
) -> SamplingInputs:
    rows = len(params)
    return SamplingInputs(
        params=params,
        prompt_token_ids=prompts or [[] for _ in range(rows)],
        output_token_ids=outputs or [[] for _ in range(rows)],
        eos_token_ids=eos or [[] for _ in range(rows)],
        request_ids=request_ids,
    )


def sampler(vocab: int) -> Sampler:
    return Sampler(vocab, CPU)


def sample(logits: torch.Tensor, inputs: SamplingInputs):
    return sampler(logits.shape[1])(logits, inputs)


def sample_many(row: list[float], params: SamplingParams, draws: int = DRAWS) -> set[int]:
    """Tokens emitted over `draws` copies of one logits row, sampled as one batch."""
    logits = torch.tensor([row]).repeat(draws, 1)
    return set(sample(logits, make_inputs([params] * draws)).token_ids)


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
    tokens = sample(logits, make_inputs(params)).token_ids
    assert set(tokens[0::2]) == {2}
    assert set(tokens[1::2]) == {0, 1, 2}


def test_greedy_picks_argmax_of_logits() -> None:
    logits = torch.randn(8, 50)
    out = sample(logits, make_inputs([SamplingParams(temperature=0.0)] * 8))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_batch_of_greedy_and_sampled_rows() -> None:
    logits = torch.randn(DRAWS, 6)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=2)] * (DRAWS // 2)
    tokens = sample(logits, make_inputs(params)).token_ids
    assert tokens[0::2] == logits[0::2].argmax(dim=-1).tolist()
    top2 = logits[1::2].topk(2, dim=-1).indices.tolist()
    assert all(token in allowed for token, allowed in zip(tokens[1::2], top2, strict=True))
    # Sampled rows really sample: they do not all collapse to the argmax.
    assert tokens[1::2] != logits[1::2].argmax(dim=-1).tolist()


def run_seeded_steps(
    logits: torch.Tensor, row: int, seeds: list[int | None], steps: int, s: Sampler | None = None
) -> list[int]:
    """Samples `steps` times, each row's output growing by its token as in a real decode;
    returns row `row`'s tokens."""
    s = s or sampler(logits.shape[1])
    params = [SamplingParams(seed=seed) for seed in seeds]
    outputs: list[list[int]] = [[] for _ in seeds]
    ids = [f"req-{i}" for i in range(len(seeds))]
    for _ in range(steps):
        tokens = s(logits, make_inputs(params, outputs=outputs, request_ids=ids)).token_ids
        for out, token in zip(outputs, tokens, strict=True):
            out.append(token)
    return outputs[row]


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


def decode_steps(s: Sampler, params: SamplingParams, output: list[int], steps: int) -> list[int]:
    logits = torch.linspace(0.0, 2.0, 500).unsqueeze(0)
    for _ in range(steps):
        inputs = make_inputs([params], prompts=[[1, 2]], outputs=[output], request_ids=["r"])
        output.append(s(logits, inputs).token_ids[0])
    return output


def test_a_seeded_request_continues_bit_exactly_on_another_sampler() -> None:
    """The prefill node samples the first token, the decode node (its own Sampler) the rest:
    the tokens equal one sampler doing all of it, with no generator state to carry over."""
    params = SamplingParams(seed=42, top_p=0.9, frequency_penalty=0.5, repetition_penalty=1.2)
    whole = decode_steps(sampler(500), params, [], 8)
    first = decode_steps(sampler(500), params, [], 1)
    assert decode_steps(sampler(500), params, first, 7) == whole
    assert len(set(whole)) > 1  # it really samples


def test_low_temperature_concentrates_mass_on_argmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]]).repeat(DRAWS, 1)

    def argmax_share(temperature: float) -> float:
        params = [SamplingParams(temperature=temperature)] * DRAWS
        tokens = sample(logits, make_inputs(params)).token_ids
        return tokens.count(0) / DRAWS

    # At T=1 the argmax has probability e^2 / (e^2 + e + 1) ~ 0.67; at T=0.1 ~ 1 - 5e-5.
    assert argmax_share(1.0) < 0.8
    assert argmax_share(0.1) > 0.99


def penalized(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    return sampler(logits.shape[1]).penalized(logits, inputs)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[1.0, 2.0, -0.5, -1.0, 3.0, 0.0]])
    inputs = make_inputs(
        [SamplingParams(repetition_penalty=2.0)], prompts=[[1, 5]], outputs=[[3, 3]]
    )
    expected = torch.tensor([[1.0, 1.0, -0.5, -2.0, 3.0, 0.0]])
    assert torch.equal(penalized(logits, inputs), expected)
    assert torch.equal(logits, torch.tensor([[1.0, 2.0, -0.5, -1.0, 3.0, 0.0]])), "input untouched"


def test_frequency_and_presence_penalties_subtract_count_terms() -> None:
    logits = torch.zeros(2, 8)
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
    ]
    # Prompt tokens do not count; row 1 has no output yet.
    inputs = make_inputs(params, prompts=[[7], [7]], outputs=[[2, 2, 5, 2], []])
    expected = torch.zeros(2, 8)
    expected[0, 2] = -(0.5 * 3 + 0.25)
    expected[0, 5] = -(0.5 * 1 + 0.25)
    assert torch.equal(penalized(logits, inputs), expected)


def test_penalties_leave_rows_without_penalties_unchanged() -> None:
    logits = torch.randn(2, 8)
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0), SamplingParams()]
    inputs = make_inputs(params, prompts=[[1], [1]], outputs=[[2], [2]])
    assert torch.equal(penalized(logits, inputs)[1], logits[1])


def test_token_counts_follow_sampled_tokens_on_the_device_across_steps() -> None:
    """Counts are filled once from the host lists, then only the device adds sampled tokens:
    after several steps they equal a recount of the output, and the penalised logits equal
    the ones a fresh sampler computes from the full host lists."""
    vocab = 50
    logits = torch.randn(3, vocab)
    params = [
        SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3),
        SamplingParams(temperature=0.0),
        SamplingParams(repetition_penalty=0.7, seed=3),
    ]
    prompts, outputs = [[1, 2, 3], [4], [5, 6]], [[7], [], [8, 8]]
    ids = ["a", "b", "c"]
    s = sampler(vocab)
    for _ in range(6):
        tokens = s(logits, make_inputs(params, prompts, outputs, request_ids=ids)).token_ids
        for out, token in zip(outputs, tokens, strict=True):
            out.append(token)
    slot = s.counts._slots["a"]
    recount = torch.bincount(torch.tensor(outputs[0]), minlength=vocab).to(torch.int32)
    assert torch.equal(s.counts.counts[slot], recount)
    fresh = penalized(logits, make_inputs(params, prompts, outputs))
    kept = s.penalized(logits, make_inputs(params, prompts, outputs, request_ids=ids))
    assert torch.equal(kept, fresh)


def test_released_requests_give_their_count_rows_back() -> None:
    counts = TokenCounts(10, CPU)
    params = SamplingParams(frequency_penalty=1.0)
    slots = {counts.slot(r, [1], [2], params) for r in ("a", "b", "c")}
    assert len(slots) == 3 and len(counts) == 3
    counts.release("b")
    reused = counts.slot("d", [], [], params)
    assert reused in slots and counts.counts[reused].sum() == 0  # cleared for its new owner


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[9.0, 1.0, 2.0, 0.0, 8.0]])
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4])
    early = make_inputs([params], outputs=[[1, 2]], eos=[[0]])
    masked = penalized(logits, early)
    assert masked[0, 0] == -math.inf and masked[0, 4] == -math.inf
    assert sample(logits, early).token_ids == [2]
    reached = make_inputs([params], outputs=[[1, 2, 3]], eos=[[0]])
    assert sample(logits, reached).token_ids == [0]


def test_ignore_eos_leaves_eos_unmasked_during_min_tokens() -> None:
    logits = torch.tensor([[9.0, 1.0, 2.0]])
    params = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert sample(logits, make_inputs([params], eos=[[0]])).token_ids == [0]


def test_logprobs_are_raw_log_softmax_and_top_n_sorted() -> None:
    logits = torch.randn(3, 30)
    params = [
        SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.8),
        SamplingParams(logprobs=0, temperature=0.0),
        SamplingParams(),
    ]
    out = sample(logits, make_inputs(params, prompts=[[1, 2, 3]] * 3))
    raw = torch.log_softmax(logits, dim=-1)

    assert out.logprobs is not None and out.top_logprobs is not None
    for row, token in enumerate(out.token_ids[:2]):
        assert out.logprobs[row] == pytest.approx(raw[row, token].item())
    assert out.logprobs[2] is None  # computed only for the rows that ask
    top = out.top_logprobs[0]
    assert top is not None and len(top) == 5
    assert [t for t, _ in top] == raw[0].topk(5).indices.tolist()
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert [lp for _, lp in top] == pytest.approx(raw[0].topk(5).values.tolist())
    assert out.top_logprobs[1] == []
    assert out.top_logprobs[2] is None


def test_no_logprobs_requested_returns_none() -> None:
    out = sample(torch.randn(2, 10), make_inputs([SamplingParams()] * 2))
    assert out.logprobs is None and out.top_logprobs is None


def test_row_count_mismatch_raises_value_error() -> None:
    with pytest.raises(ValueError, match="does not match"):
        sample(torch.randn(3, 10), make_inputs([SamplingParams()] * 2))


def nucleus_by_sort(probs: torch.Tensor, top_p: float) -> set[int]:
    """The reference: sort, keep while the mass before a token is below top_p."""
    values, order = probs.sort(descending=True)
    before = values.cumsum(0) - values
    return set(order[before < top_p].tolist())


@pytest.mark.parametrize("top_p", [0.01, 0.3, 0.5, 0.9, 0.999])
def test_top_p_threshold_without_sort_keeps_exactly_the_sorted_nucleus(top_p: float) -> None:
    logits = torch.randn(64, 300) * torch.linspace(0.1, 5.0, 64).unsqueeze(1)
    probs = logits.softmax(dim=-1)
    threshold = ops.top_p_threshold(probs, torch.full((64,), top_p))
    for row in range(64):
        kept = set(torch.nonzero(probs[row] >= threshold[row]).flatten().tolist())
        assert kept == nucleus_by_sort(probs[row], top_p), row


def test_top_k_mask_keeps_the_k_largest_and_leaves_disabled_rows() -> None:
    logits = torch.randn(4, 40)
    masked = ops.top_k_mask_(logits.clone(), torch.tensor([1, 5, 0, 40]), k_max=5)
    for row, k in ((0, 1), (1, 5)):
        kept = torch.nonzero(masked[row] > -math.inf).flatten().tolist()
        assert set(kept) == set(logits[row].topk(k).indices.tolist())
    assert torch.equal(masked[2:], logits[2:])


def test_noise_hash_matches_the_host_hash_and_is_unit_exponential() -> None:
    x = torch.tensor([0, 1, 2, 12345, 2**32 - 1], dtype=torch.int64)
    assert ops.hash32(x).tolist() == [ops.hash32_int(v) for v in x.tolist()]
    salts = ops.token_salts(100_000, CPU)
    q = ops.exponential_noise(torch.tensor([ops.draw_key(7, 0), ops.draw_key(7, 1)]), salts)
    assert q.min() > 0
    assert q.mean().item() == pytest.approx(1.0, abs=0.02)  # 1e5 draws: sd of the mean 0.003
    assert q[0].var().item() == pytest.approx(1.0, abs=0.05)
    assert (q[0] == q[1]).float().mean() < 0.01  # a new draw index, new noise


def test_a_rows_noise_does_not_depend_on_the_other_rows() -> None:
    salts = ops.token_salts(1000, CPU)
    alone = ops.exponential_noise(torch.tensor([99]), salts)
    batch = ops.exponential_noise(torch.tensor([5, 99, 7]), salts)
    assert torch.equal(alone[0], batch[1])


def test_all_greedy_rows_take_the_argmax_fast_path() -> None:
    s = sampler(10)
    plan = s.plan(make_inputs([SamplingParams(temperature=0.0)] * 3), (3, 10))
    assert plan.greedy_only and plan.logprob_rows is None and plan.row_keys is None
    mixed = s.plan(
        make_inputs([SamplingParams(temperature=0.0, logprobs=2), SamplingParams()]), (2, 10)
    )
    assert not mixed.greedy_only and mixed.logprob_rows == [0]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_on_every_device_the_noise_bits_equal_the_host_hash(device: str) -> None:
    x = torch.arange(0, 2**32, 2**20 + 7, dtype=torch.int64)
    assert ops.hash32(x.to(device)).cpu().tolist() == [ops.hash32_int(v) for v in x.tolist()]


@pytest.mark.parametrize("device", DEVICES)
def test_on_every_device_top_p_without_sort_equals_the_sorted_nucleus(device: str) -> None:
    logits = torch.randn(32, 4000) * torch.linspace(0.2, 6.0, 32).unsqueeze(1)
    probs = logits.softmax(dim=-1).to(device)
    threshold = ops.top_p_threshold(probs, torch.full((32,), 0.8, device=device)).cpu()
    probs = probs.cpu()
    for row in range(32):
        kept = set(torch.nonzero(probs[row] >= threshold[row]).flatten().tolist())
        assert kept == nucleus_by_sort(probs[row], 0.8), row


@pytest.mark.parametrize("device", DEVICES)
def test_on_every_device_a_seeded_row_ignores_its_batch_neighbours(device: str) -> None:
    logits = torch.randn(8, 3000, device=device)
    params = [
        SamplingParams(seed=9, top_p=0.9, top_k=100, frequency_penalty=0.4)
        if i == 3
        else SamplingParams(temperature=0.0 if i % 2 else 1.2, min_p=0.05)
        for i in range(8)
    ]
    s = Sampler(3000, torch.device(device))
    ids = [f"r{i}" for i in range(8)]
    batch = s(logits, make_inputs(params, outputs=[[1, 2]] * 8, request_ids=ids)).token_ids
    alone = Sampler(3000, torch.device(device))(
        logits[3:4], make_inputs(params[3:4], outputs=[[1, 2]], request_ids=["r3"])
    ).token_ids
    assert batch[3] == alone[0]
