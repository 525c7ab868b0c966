"""Speculative verification in the sampler (CPU torch): greedy verification equals sequential
sampling, a sequence without drafts equals `sample`, seeds reproduce, and token counts follow
only the emitted tokens."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from common.engine.sampler import (
    Sampler,
    SamplingInputs,
    VerifiedOutput,
    to_host,
    verified_to_host,
)
from common.protocol.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 40
PROMPT = [3, 4, 5]
EOS = [0]


@pytest.fixture(autouse=True)
def _seed_default_rng() -> None:
    torch.manual_seed(0)


def inputs_for(
    params: list[SamplingParams], outputs: list[Sequence[int]], ids: list[str] | None = None
) -> SamplingInputs:
    rows = len(params)
    return SamplingInputs(params, [PROMPT] * rows, outputs, [EOS] * rows, ids)


def verify(
    s: Sampler,
    logits: torch.Tensor,
    inputs: SamplingInputs,
    drafts: list[list[int]],
    draft_probs: torch.Tensor | None = None,
) -> VerifiedOutput:
    plan = s.plan_verify(inputs, drafts, tuple(logits.shape))
    return verified_to_host(s.verify(logits.clone(), plan, draft_probs), plan)


def sequential(
    params: SamplingParams, rows: torch.Tensor, output: list[int], draft: list[int]
) -> tuple[list[int], list[float | None]]:
    """The reference: sample row j with output + what was emitted so far (a fresh sampler that
    reads every token from the host), continue while the token equals draft j."""
    emitted: list[int] = []
    logprobs: list[float | None] = []
    for j in range(len(draft) + 1):
        out = Sampler(VOCAB, CPU)(rows[j : j + 1], inputs_for([params], [output + emitted]))
        emitted.append(out.token_ids[0])
        logprobs.append(None if out.logprobs is None else out.logprobs[0])
        if j == len(draft) or emitted[-1] != draft[j]:
            break
    return emitted, logprobs


def greedy_chain(params: SamplingParams, rows: torch.Tensor, output: list[int]) -> list[int]:
    """The token sequential greedy sampling takes at every row (each row fed the chain so far)."""
    chain: list[int] = []
    for j in range(rows.shape[0]):
        out = Sampler(VOCAB, CPU)(rows[j : j + 1], inputs_for([params], [output + chain]))
        chain.append(out.token_ids[0])
    return chain


GREEDY = [
    SamplingParams(temperature=0.0, repetition_penalty=1.6, frequency_penalty=0.7, logprobs=3),
    SamplingParams(temperature=0.0, presence_penalty=2.0, min_tokens=5, stop_token_ids=[7]),
    SamplingParams(temperature=0.0, logprobs=0),
    SamplingParams(temperature=0.0, frequency_penalty=2.0, min_tokens=4),
]


@pytest.mark.parametrize("reject_at", [None, 0, 1, 2])
def test_greedy_verify_emits_exactly_what_sequential_greedy_sampling_emits(
    reject_at: int | None,
) -> None:
    """Mixed k (0 to 4) per sequence; the drafts follow the sequential greedy chain, except one
    wrong token at `reject_at` (None: all accepted, the bonus token comes from the last row).
    Penalties count the accepted drafts, min_tokens masks EOS and stop ids by position."""
    ks = [4, 3, 0, 2]
    outputs = [[9, 9, 1], [2], [], [0, 6]]
    # Logits that favour repeating tokens already seen, so penalties change the argmax.
    blocks = [torch.randn(k + 1, VOCAB) * 2.0 for k in ks]
    for block in blocks:
        block[:, [0, 7, 9, 6]] += 3.0
    drafts = []
    expected = []
    unprocessed = 0
    for params, block, output, k in zip(GREEDY, blocks, outputs, ks, strict=True):
        chain = greedy_chain(params, block, output)
        unprocessed += chain != block.argmax(dim=-1).tolist()
        draft = chain[:k]
        if reject_at is not None and reject_at < k:
            draft[reject_at] = (draft[reject_at] + 1) % VOCAB
        drafts.append(draft)
        expected.append(sequential(params, block, output, draft))
    assert unprocessed >= 2  # penalties and min_tokens change the chains' tokens
    s = Sampler(VOCAB, CPU)
    ids = ["a", "b", "c", "d"]
    out = verify(s, torch.cat(blocks), inputs_for(GREEDY, outputs, ids), drafts)

    assert out.token_ids == [tokens for tokens, _ in expected]
    assert out.logprobs is not None
    for got, (_, logprobs) in zip(out.logprobs, expected, strict=True):
        assert got == (None if logprobs[0] is None else pytest.approx(logprobs))
    assert out.top_logprobs is not None and out.top_logprobs[1] is None
    raw = torch.log_softmax(blocks[0], dim=-1)
    for j, top in enumerate(out.top_logprobs[0]):  # logprobs=3: one list per emitted token
        assert [t for t, _ in top] == raw[j].topk(3).indices.tolist()
        assert [lp for _, lp in top] == pytest.approx(raw[j].topk(3).values.tolist())
    assert out.top_logprobs[2] == [[]]
    if reject_at is None:
        assert [len(t) for t in out.token_ids] == [k + 1 for k in ks]
    elif reject_at == 0:
        assert [len(t) for t in out.token_ids] == [1, 1, 1, 1]
    # The stored counts hold the emitted tokens, not the rejected drafts.
    for i in (0, 1, 3):
        slot = s.counts._slots[ids[i]]
        recount = torch.bincount(torch.tensor(outputs[i] + out.token_ids[i], dtype=torch.int64),
                                 minlength=VOCAB).to(torch.int32)  # fmt: skip
        assert torch.equal(s.counts.counts[slot], recount), i


def test_greedy_verify_continues_over_steps_like_sequential_decoding() -> None:
    """Three verify steps of one penalised sequence on the same sampler (counts kept on the
    device between steps) emit the tokens that a fresh sequential reference emits."""
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0, repetition_penalty=1.3)
    s = Sampler(VOCAB, CPU)
    output: list[int] = [1, 2]
    for step in range(3):
        block = torch.randn(4, VOCAB)
        chain = greedy_chain(params, block, output)
        draft = chain[:3] if step != 1 else [chain[0], (chain[1] + 5) % VOCAB, chain[2]]
        expected, _ = sequential(params, block, output, draft)
        got = verify(s, block, inputs_for([params], [output], ["r"]), [draft]).token_ids[0]
        assert got == expected
        output = output + got


MIXED = [
    SamplingParams(temperature=0.0, frequency_penalty=0.5, logprobs=2),
    SamplingParams(seed=11, top_k=5, repetition_penalty=1.4, logprobs=4),
    SamplingParams(seed=12, top_p=0.8, min_p=0.05, min_tokens=3),
    SamplingParams(temperature=0.7, presence_penalty=0.3),
    SamplingParams(seed=14, temperature=1.3, logprobs=0),
]


def test_verify_without_drafts_equals_sample() -> None:
    logits = torch.randn(len(MIXED), VOCAB)
    outputs = [[1, 2], [3], [], [5, 5], [8]]
    ids = [f"r{i}" for i in range(len(MIXED))]
    params = (
        MIXED[:3] + [SamplingParams(seed=13, temperature=0.7, presence_penalty=0.3)] + MIXED[4:]
    )
    a, b = Sampler(VOCAB, CPU), Sampler(VOCAB, CPU)
    plan = a.plan(inputs_for(params, outputs, ids), tuple(logits.shape))
    sampled = to_host(a.sample(logits.clone(), plan), plan)
    verified = verify(b, logits, inputs_for(params, outputs, ids), [[]] * len(params))

    assert verified.token_ids == [[t] for t in sampled.token_ids]
    assert verified.logprobs == [None if lp is None else [lp] for lp in sampled.logprobs]
    assert verified.top_logprobs == [None if t is None else [t] for t in sampled.top_logprobs]
    assert torch.equal(a.counts.counts, b.counts.counts)


def test_after_accepting_every_draft_the_bonus_token_is_the_sequential_seeded_draw() -> None:
    """Rows 0-2 put all their mass (p = 1.0 in float32) on the drafted tokens, so the drafts
    are accepted; the free last row draws the token a seeded sequential sample draws at draw
    index len(output) + 3."""
    params = SamplingParams(seed=5, top_p=0.95)
    block = torch.randn(4, VOCAB)
    draft = [6, 1, 6]
    block[torch.arange(3), draft] += 200.0
    out = verify(Sampler(VOCAB, CPU), block, inputs_for([params], [[4]]), [draft])
    sequential_draw = Sampler(VOCAB, CPU)(block[3:], inputs_for([params], [[4] + draft]))
    assert out.token_ids == [draft + sequential_draw.token_ids]


def test_seeded_verify_repeats_and_ignores_its_batch_neighbours() -> None:
    logits = torch.randn(2 + 4 + 3 + 1 + 3, VOCAB)
    drafts = [[1], [2, 3, 4], [5, 6], [], [7, 8]]
    outputs = [[1], [2, 2], [], [9], [4]]
    ids = [f"r{i}" for i in range(5)]
    probs = torch.softmax(torch.randn(sum(map(len, drafts)), VOCAB), dim=-1)
    first = verify(Sampler(VOCAB, CPU), logits, inputs_for(MIXED, outputs, ids), drafts, probs)
    again = verify(Sampler(VOCAB, CPU), logits, inputs_for(MIXED, outputs, ids), drafts, probs)
    seeded = [0, 1, 2, 4]  # sequence 3 has no seed
    assert [first.token_ids[i] for i in seeded] == [again.token_ids[i] for i in seeded]
    assert [first.logprobs[i] for i in seeded] == [again.logprobs[i] for i in seeded]
    # Sequence 1 alone: its rows 2..5 of the logits, its drafts' rows 1..3 of the probs.
    alone = verify(
        Sampler(VOCAB, CPU),
        logits[2:6],
        inputs_for(MIXED[1:2], outputs[1:2], ["r1"]),
        drafts[1:2],
        probs[1:4],
    )
    assert alone.token_ids == first.token_ids[1:2]
    assert alone.logprobs == [first.logprobs[1]] and alone.top_logprobs == [first.top_logprobs[1]]


def test_different_seeds_reject_and_resample_differently() -> None:
    logits = torch.zeros(2, VOCAB)  # uniform target: a draft is accepted with probability 1/V
    runs = {
        tuple(
            verify(
                Sampler(VOCAB, CPU), logits, inputs_for([SamplingParams(seed=seed)], [[]]), [[3]]
            ).token_ids[0]
        )  # fmt: skip
        for seed in range(20)
    }
    assert len(runs) > 5


def test_bad_drafts_and_shapes_raise_value_errors() -> None:
    s = Sampler(VOCAB, CPU)
    inputs = inputs_for([SamplingParams()] * 2, [[], []])
    with pytest.raises(ValueError, match="1 draft lists for 2 sequences"):
        s.plan_verify(inputs, [[1]])
    with pytest.raises(ValueError, match=r"sequence 1: draft tokens \[3, 40\]"):
        s.plan_verify(inputs, [[], [3, 40]])
    with pytest.raises(ValueError, match=r"\(4, 40\) does not match 2 sequences with 1 drafts"):
        s.plan_verify(inputs, [[1], []], (4, VOCAB))
    plan = s.plan_verify(inputs, [[1], []], (3, VOCAB))
    with pytest.raises(ValueError, match=r"draft_probs shape \(2, 40\) is not \(1, 40\)"):
        s.verify(torch.randn(3, VOCAB), plan, torch.zeros(2, VOCAB))
