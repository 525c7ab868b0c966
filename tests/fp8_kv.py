"""What the FP8 KV-cache tests share: the marker of tests that need attention backends reading
and writing float8 pools, and a tiny checkpoint with per-layer KV scales."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from common.model.attention import ForwardContext
from tests.node_harness import save_tiny_model

# The backends take FP8 KV once ForwardContext takes its scales; until then an FP8 engine
# cannot run (an "auto" one never passes them).
needs_fp8_attention = pytest.mark.skipif(
    "k_scales" not in inspect.signature(ForwardContext.__init__).parameters,
    reason="the attention backends do not take FP8 KV scales yet",
)

K_SCALES, V_SCALES = [0.5, 1.0], [1.0, 0.25]  # per layer of the tiny model (2 layers)


def save_tiny_model_with_kv_scales(folder: Path) -> str:
    """The tests' tiny random Qwen2, plus `self_attn.k_scale` / `v_scale` of K_SCALES,
    V_SCALES (layer 1's V scale under its older name, `v_proj.output_scale`)."""
    from safetensors.torch import load_file, save_file

    save_tiny_model(folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(K_SCALES[0])
    tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor([V_SCALES[1]])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)
