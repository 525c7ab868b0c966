"""The fused sampler kernels (`common/model/kernels/sampling.py`) against the torch reference in
`common/engine/sampling_ops.py`: same noise bits, same draws, same top-p thresholds. Without CUDA they
run in Triton's CPU interpreter (set before the kernels are decorated)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from common.engine import sampling_ops as ops  # noqa: E402
from common.model.kernels import sampling  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def keys(n: int) -> torch.Tensor:
    return torch.tensor([ops.draw_key(1000 + i, i) for i in range(n)], device=DEVICE)


def test_race_kernel_draws_the_reference_tokens():
    torch.manual_seed(0)
    probs = (torch.randn(16, 3000) * 2).softmax(dim=-1).to(DEVICE)
    row_keys = keys(16)
    salts = ops.token_salts(3000, DEVICE)
    expected = probs.clone().div_(ops.exponential_noise(row_keys, salts)).argmax(dim=-1)
    assert sampling.race(probs, row_keys).tolist() == expected.tolist()


def test_race_kernel_rows_do_not_depend_on_their_neighbours():
    probs = torch.rand(6, 2500).softmax(dim=-1).to(DEVICE)
    row_keys = keys(6)
    together = sampling.race(probs, row_keys)
    alone = sampling.race(probs[4:5].contiguous(), row_keys[4:5])
    assert together[4].item() == alone[0].item()


def test_top_p_kernel_keeps_the_reference_nucleus():
    """Rows from flat to peaked, each with its own top-p (the limit is per row)."""
    torch.manual_seed(1)
    logits = torch.randn(8, 2000) * torch.linspace(0.3, 5.0, 8).unsqueeze(1)
    probs = logits.softmax(dim=-1).to(DEVICE)
    limit = torch.tensor([0.05, 0.5, 0.9, 0.05, 0.5, 0.9, 0.99, 0.3], device=DEVICE)
    ours = sampling.top_p_threshold(probs, limit)
    reference = ops.top_p_threshold(probs, limit)
    for row in range(8):
        kept = torch.nonzero(probs[row] >= ours[row]).flatten().tolist()
        expected = torch.nonzero(probs[row] >= reference[row]).flatten().tolist()
        assert kept == expected, row


def test_top_p_kernel_rows_do_not_depend_on_their_neighbours():
    torch.manual_seed(2)
    probs = (torch.randn(3, 9000) * 3).softmax(dim=-1).to(DEVICE)  # rows over two chunks
    limit = torch.tensor([0.3, 0.9, 0.7], device=DEVICE)
    together = sampling.top_p_threshold(probs, limit)
    alone = sampling.top_p_threshold(probs[1:2].contiguous(), limit[1:2])
    assert together[1].item() == alone[0].item()


def test_race_floor_drops_the_tokens_below_it():
    torch.manual_seed(3)
    probs = (torch.randn(4, 9000) * 2).softmax(dim=-1).to(DEVICE)
    row_keys = keys(4)
    floor = probs.amax(dim=1) * torch.tensor([0.0, 0.2, 0.5, 1.0], device=DEVICE)
    masked = torch.where(probs >= floor.unsqueeze(1), probs, 0.0)
    expected = sampling.race(masked, row_keys)  # a cut by zeroing, the same race
    chosen = sampling.race(probs, row_keys, floor)
    assert chosen.tolist() == expected.tolist()
    assert chosen[3].item() == probs[3].argmax().item()  # floor at the peak: only the top token
    assert (probs.gather(1, chosen.unsqueeze(1)).squeeze(1) >= floor).all()


def test_penalty_kernel_matches_the_reference_in_place_on_its_rows():
    torch.manual_seed(4)
    vocab = 9000
    logits = torch.randn(6, vocab).to(DEVICE)
    counts = torch.randint(0, 3, (4, vocab), dtype=torch.int32).to(DEVICE)
    seen = (torch.rand(4, vocab) < 0.1).to(DEVICE)
    rows = torch.tensor([4, 1, 2], device=DEVICE)
    slots = torch.tensor([0, 3, 1], device=DEVICE)
    penalties = torch.tensor([[1.2, 0.3, 0.1], [0.8, 0.0, 0.5], [1.0, 0.5, 0.0]], device=DEVICE)
    expected = logits.clone()
    rep, freq, pres = penalties.unbind(1)
    expected[rows] = ops.apply_penalties_(
        expected[rows], counts[slots], seen[slots], rep, freq, pres
    )
    ours = logits.clone()
    sampling.apply_penalties_(ours, rows, slots, counts, seen, penalties)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    untouched = [0, 3, 5]
    assert torch.equal(ours[untouched], logits[untouched])


def test_the_fused_top_p_and_min_p_cut_draws_the_reference_tokens(monkeypatch):
    """`sampling_ops.filtered_race` on its kernel path (one softmax, the cuts as a floor of the
    race) against its torch path (masks, a softmax per cut)."""
    torch.manual_seed(5)
    logits = (torch.randn(4, 9000) * 3).to(DEVICE)  # rows over two chunks
    row_keys = keys(4)
    salts = ops.token_salts(9000, DEVICE)
    top_p = torch.tensor([0.5, 0.9, 1.0, 0.3], device=DEVICE)
    min_p = torch.tensor([0.0, 0.05, 0.1, 0.2], device=DEVICE)
    for cuts in ((top_p, None), (None, min_p), (top_p, min_p)):
        monkeypatch.setattr(ops, "_use_triton", lambda x: False)
        reference = ops.filtered_race(logits.clone(), *cuts, row_keys, salts)
        monkeypatch.setattr(ops, "_use_triton", lambda x: True)
        fused = ops.filtered_race(logits.clone(), *cuts, row_keys, salts)
        assert fused.tolist() == reference.tolist(), cuts
