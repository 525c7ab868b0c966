"""The engine benchmark's floors on a real (tiny) FP8 model: a decode step reads FP8 weights at
one byte and their scales at four; a prefill runs FP8 matmuls at the FP8 rate, the rest at bf16's."""

from __future__ import annotations

import pytest
import torch

from benchmarks.fp8_config import write_block_config
from benchmarks.roofline import matmul_params, prefill_floors, weight_bytes
from common.model.loader import build_model
from common.model.source import read_spec, resolve_model
from tests.pd_stack import ROOT

CEIL = {"copy_bytes_per_s": 1e12, "bf16_flops_per_s": 1e14, "fp8_flops_per_s": 3e14}


def tiny(tmp_path, plain: bool):
    src = ROOT / "benchmarks" / "configs" / "qwen3-8b"
    source = resolve_model(str(write_block_config(src, tmp_path / str(plain), True, plain)))
    spec = read_spec(source)
    model = build_model(spec, source, max_positions=256, dtype=torch.float32,
                        device=torch.device("cpu"), load_format="dummy")  # fmt: skip
    return spec, model


def test_fp8_weights_read_one_byte_and_their_matmuls_run_at_the_fp8_rate(tmp_path):
    spec, plain = tiny(tmp_path, plain=True)
    _, fp8 = tiny(tmp_path, plain=False)
    high, none = matmul_params(plain)
    assert none == 0 and matmul_params(fp8) == (0, high)  # every decoder linear, no scale
    scales = sum(p.numel() * 4 for n, p in fp8.named_parameters() if "scale" in n)
    assert scales > 0
    assert weight_bytes(plain) - weight_bytes(fp8) == 3 * high - scales  # fp32 -> 1 byte
    n = 64
    a, b = prefill_floors(plain, spec, n, CEIL), prefill_floors(fp8, spec, n, CEIL)
    assert (a["matmul_ceiling"], b["matmul_ceiling"]) == ("bf16", "fp8")
    saved = 2 * n * high * (1 / CEIL["bf16_flops_per_s"] - 1 / CEIL["fp8_flops_per_s"])
    assert a["flop_floor_s"] - b["flop_floor_s"] == pytest.approx(saved, rel=1e-9)
    with pytest.raises(ValueError, match="no FP8 matmul ceiling"):
        prefill_floors(fp8, spec, n, {**CEIL, "fp8_flops_per_s": None})
