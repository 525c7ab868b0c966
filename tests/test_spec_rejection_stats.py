"""Rejection sampling preserves the target distribution: many seeded verify steps over a tiny
vocabulary, chi-square tests of the first emitted token and of the second given the first
draft's acceptance, against the filtered target computed here by sorting (scipy is not
installed: the statistic is computed here and compared with the p = 0.001 critical value).
The same test rejects a sampler that is wrong on purpose, so it has power."""

from __future__ import annotations

import pytest
import torch

from common.engine.sampler import Sampler, SamplingInputs, verified_to_host
from common.protocol.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 8
SEQS = 20_000
CALLS = 4  # SEQS sequences in CALLS batched verify calls
# The chi-square distribution's upper 0.001 quantile for 1..7 degrees of freedom.
CRITICAL_0001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}

_LOGITS = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1234)) * 1.2
# The draft distributions of the two drafted positions (a draft model ignoring its context).
_DRAFT_Q = torch.softmax(
    torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(99)) * 1.5, dim=-1
)

PARAMS = {
    "temperature": dict(temperature=0.8),
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.8, temperature=1.3),
    "top_k_top_p_min_p": dict(top_k=6, top_p=0.9, min_p=0.05, temperature=1.1),
}


def target(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The filtered target distribution, the reference way: float64, sort-based."""
    x = row.double() / params.temperature
    if params.top_k > 0:
        x[x < x.sort(descending=True).values[params.top_k - 1]] = -torch.inf
    p = x.softmax(dim=0)
    if params.top_p < 1.0:
        values, order = p.sort(descending=True)
        drop = order[(values.cumsum(0) - values) >= params.top_p]
        p[drop] = 0.0
        p /= p.sum()
    if params.min_p > 0.0:
        p[p < params.min_p * p.max()] = 0.0
        p /= p.sum()
    return p


def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the support of `probs` and its degrees of freedom; a token
    outside the support that was observed makes the statistic infinite."""
    support = probs > 0
    if observed[~support].sum() > 0:
        return float("inf"), int(support.sum()) - 1
    total = observed.sum().item()
    expected = probs[support] * total
    assert expected.min() >= 5, "too few samples for the chi-square approximation"
    stat = ((observed[support].double() - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


def run_verify(name: str, random_drafts: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """SEQS seeded sequences with two drafts each over the rows `_LOGITS`: the drafts fixed
    (one-hot proposals: 2nd most likely target token, then the most likely) or drawn from
    `_DRAFT_Q` with their probabilities. Returns each sequence's drafts [SEQS, 2] and emitted
    tokens [SEQS, 3] (-1 padded)."""
    per_call = SEQS // CALLS
    generator = torch.Generator().manual_seed(7)
    all_drafts, emitted = [], []
    for call in range(CALLS):
        if random_drafts:
            drafts = torch.stack(
                [torch.multinomial(q, per_call, replacement=True, generator=generator)
                 for q in _DRAFT_Q], dim=1,
            )  # fmt: skip
            probs = _DRAFT_Q.repeat(per_call, 1)
        else:
            first = int(_LOGITS[0].sort(descending=True).indices[1])
            drafts = torch.tensor([[first, int(_LOGITS[1].argmax())]]).repeat(per_call, 1)
            probs = None
        seeds = range(call * per_call, (call + 1) * per_call)
        inputs = SamplingInputs(
            [SamplingParams(seed=seed, **PARAMS[name]) for seed in seeds],
            [[]] * per_call, [[]] * per_call, [[]] * per_call,
        )  # fmt: skip
        s = Sampler(VOCAB, CPU)
        plan = s.plan_verify(inputs, drafts.tolist(), (3 * per_call, VOCAB))
        out = verified_to_host(s.verify(_LOGITS.repeat(per_call, 1), plan, probs), plan)
        all_drafts.append(drafts)
        emitted.append(torch.tensor([t + [-1] * (3 - len(t)) for t in out.token_ids]))
    return torch.cat(all_drafts), torch.cat(emitted)


def counts(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=VOCAB)


@pytest.mark.parametrize("random_drafts", [False, True], ids=["one_hot_drafts", "draft_probs"])
@pytest.mark.parametrize("name", list(PARAMS))
def test_rejection_sampling_preserves_the_target_distribution(
    name: str, random_drafts: bool
) -> None:
    params = SamplingParams(**PARAMS[name])
    drafts, emitted = run_verify(name, random_drafts)
    p0, p1 = (target(_LOGITS[j], params) for j in range(2))

    stat, df = chi_square(counts(emitted[:, 0]), p0)
    assert stat < CRITICAL_0001[df], (stat, df)
    # Given the first draft accepted, the second token follows row 1's target.
    accepted = emitted[:, 1] >= 0
    assert accepted.sum() > 1000  # both branches are exercised
    assert (emitted[accepted, 0] == drafts[accepted, 0]).all()
    stat, df = chi_square(counts(emitted[accepted, 1]), p1)
    assert stat < CRITICAL_0001[df], (stat, df)


@pytest.mark.parametrize("random_drafts", [False, True], ids=["one_hot_drafts", "draft_probs"])
def test_the_chi_square_test_rejects_wrong_samplers(random_drafts: bool) -> None:
    """Two wrong samplers fail it: one that always keeps the draft, and one that, after a
    rejection, draws from the target itself instead of the residual max(p - q, 0)."""
    params = SamplingParams(**PARAMS["temperature"])
    drafts, emitted = run_verify("temperature", random_drafts)
    p0 = target(_LOGITS[0], params)
    stat, df = chi_square(counts(drafts[:, 0]), p0)
    assert stat > CRITICAL_0001[df]

    plain = Sampler(VOCAB, CPU)(
        _LOGITS[:1].repeat(SEQS, 1),
        SamplingInputs(
            [SamplingParams(seed=SEQS + i, **PARAMS["temperature"]) for i in range(SEQS)],
            [[]] * SEQS,
            [[]] * SEQS,
            [[]] * SEQS,
        ),  # fmt: skip
    ).token_ids
    accepted = emitted[:, 1] >= 0
    wrong = torch.where(accepted, emitted[:, 0], torch.tensor(plain))
    stat, df = chi_square(counts(wrong), p0)
    assert stat > CRITICAL_0001[df], stat
    # The sequential sampler's own draws pass, as a control.
    stat, df = chi_square(counts(torch.tensor(plain)), p0)
    assert stat < CRITICAL_0001[df], stat
