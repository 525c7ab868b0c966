"""The fused sampler kernels (`common/kernels/sampling.py`) against the torch reference in
`common/sampling_ops.py`: same noise bits, same draws, same top-p thresholds. Without CUDA they
run in Triton's CPU interpreter (set before the kernels are decorated)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from common import sampling_ops as ops  # noqa: E402
from common.kernels import sampling  # noqa: E402

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


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9])
def test_top_p_kernel_keeps_the_reference_nucleus(top_p):
    torch.manual_seed(1)
    logits = torch.randn(8, 2000) * torch.linspace(0.3, 5.0, 8).unsqueeze(1)
    probs = logits.softmax(dim=-1).to(DEVICE)
    limit = torch.full((8,), top_p, device=DEVICE)
    ours = sampling.top_p_threshold(probs, limit)
    reference = ops.top_p_threshold(probs, limit)
    for row in range(8):
        kept = torch.nonzero(probs[row] >= ours[row]).flatten().tolist()
        expected = torch.nonzero(probs[row] >= reference[row]).flatten().tolist()
        assert kept == expected, row
