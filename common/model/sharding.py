"""Cut one rank's slice out of a full checkpoint tensor (`common.model.parallel` says which slice).

Every weight source goes through the full tensors: an HF directory (and a GGUF, converted to
one) yields them, and dummy weights are drawn at full size in the single-rank order
(`dummy_full_tensors`), so a model at any TP size computes with the same weights.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from common.model.parallel import TPLayout
from common.model.spec import ModelSpec


class Sharder:
    """Checkpoint names (`...q_proj.weight`, never our fused ones) -> this rank's slice."""

    def __init__(self, spec: ModelSpec, layout: TPLayout, rank: int) -> None:
        self.layout, self.rank, self.head_dim = layout, rank, spec.head_dim

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.layout.size == 1:
            return tensor
        lay, r, hd = self.layout, self.rank, self.head_dim
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return self._vocab_rows(tensor)
        if ".q_proj." in name:
            return _rows(tensor, lay.q_heads(r), hd, dim=0)
        if ".k_proj." in name or ".v_proj." in name:
            return _rows(tensor, lay.kv_heads(r), hd, dim=0)
        if ".gate_proj." in name or ".up_proj." in name:
            return _rows(tensor, lay.intermediate(r), 1, dim=0)
        if ".o_proj." in name:
            return _rows(tensor, lay.q_heads(r), hd, dim=1)
        if ".down_proj." in name:
            return _rows(tensor, lay.intermediate(r), 1, dim=1)
        return tensor  # norms: replicated

    def _vocab_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        rows = self.layout.vocab(self.rank)
        part = tensor[rows.start : rows.stop]
        pad = self.layout.vocab_per_rank - len(rows)
        if pad:
            part = torch.cat([part, part.new_zeros(pad, *part.shape[1:])])
        return part


def _rows(tensor: torch.Tensor, units: range, width: int, dim: int) -> torch.Tensor:
    return tensor.narrow(dim, units.start * width, len(units) * width)


# our fused parameter -> its checkpoint parts, in order
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def unfuse(name: str, tensor: torch.Tensor, spec: ModelSpec) -> list[tuple[str, torch.Tensor]]:
    """A full fused tensor (our names) as the checkpoint tensors it was spliced from."""
    for fused, parts in _FUSED.items():
        if f".{fused}." in name:
            if fused == "qkv_proj":
                sizes = [spec.q_size, spec.kv_size, spec.kv_size]
            else:
                sizes = [spec.intermediate_size] * 2
            return [
                (name.replace(f".{fused}.", f".{p}."), t)
                for p, t in zip(parts, tensor.split(sizes), strict=True)
            ]
    return [(name, tensor)]


def dummy_full_tensors(
    spec: ModelSpec, max_positions: int, seed: int, dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """The random weights a single-rank model of `spec` gets from `fill_dummy_weights`, one
    full tensor at a time, in checkpoint names: the same draws, so TP n equals TP 1."""
    from common.model.llama import LlamaForCausalLM

    with torch.device("meta"):
        full = LlamaForCausalLM(spec, max_positions)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, meta in full.named_parameters():
        tensor = torch.empty(meta.shape, dtype=dtype, device=device)
        if "norm" in name:
            tensor.uniform_(0.9, 1.1, generator=generator)
        else:
            tensor.normal_(0.0, 0.02, generator=generator)
        yield from unfuse(name, tensor, spec)
