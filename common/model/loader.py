"""Build our model for a resolved checkpoint (`common/model/source.py`) and fill its weights:
from an HF directory (*.safetensors, sharded or not; a GGUF file arrives as its cached
conversion), or `load_format="dummy"`: random weights from a config.json alone, for
benchmarks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from common.model.distributed import TPGroup
from common.model.llama import STACKED_PARAMS, LlamaForCausalLM
from common.model.parallel import TPLayout, rank_spec
from common.model.sharding import Sharder, dummy_full_tensors
from common.model.source import ModelSource
from common.model.spec import ModelSpec

log = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "dummy")


def build_model(
    spec: ModelSpec,
    source: ModelSource,
    *,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    tp: TPGroup | None = None,
) -> LlamaForCausalLM:
    """The model of `spec` (the full model's) for rank `tp.rank` of `tp.size`: built from the
    rank's spec, its weights cut from the full checkpoint (or full dummy tensors)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    tp = tp or TPGroup.single()
    layout = TPLayout.of(spec, tp.size)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(rank_spec(spec, layout), max_positions, tp)
    finally:
        torch.set_default_dtype(previous)
    if torch.device(device).type == "meta":
        return model.eval()  # shapes only, no memory: for sizing a model (parameter counts)
    shard = Sharder(spec, layout, tp.rank)
    with torch.no_grad():
        if load_format == "dummy" and tp.size == 1:
            fill_dummy_weights(model, seed)
        elif load_format == "dummy":
            load_weights(model, dummy_full_tensors(spec, max_positions, seed, dtype, device), shard)
        else:
            load_weights(model, iter_safetensors(source.directory), shard)
    return model.eval()


def iter_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors files in {directory} (use load_format='dummy' for random weights)"
        )
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            total += len(handle.keys())
    progress = _Progress(total)
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                progress.tensor_done(tensor.numel() * tensor.element_size())
                yield name, tensor


class _Progress:
    """Logs weight loading at most every 2 s and once at the end, so a node that loads a
    large checkpoint shows how far it is."""

    def __init__(self, num_tensors: int) -> None:
        self.total, self.done, self.bytes = num_tensors, 0, 0
        self.start = self.last = time.monotonic()

    def tensor_done(self, nbytes: int) -> None:
        self.done += 1
        self.bytes += nbytes
        now = time.monotonic()
        if now - self.last >= 2.0 or self.done == self.total:
            self.last = now
            log.info(
                "loading weights: %d/%d tensors (%.0f%%), %.2f GB in %.1f s",
                self.done,
                self.total,
                100.0 * self.done / self.total,
                self.bytes / 1e9,
                now - self.start,
            )


def load_weights(
    model: LlamaForCausalLM,
    weights: Iterator[tuple[str, torch.Tensor]],
    shard: Sharder | None = None,
) -> None:
    """Copy checkpoint tensors into our parameters, splicing q/k/v and gate/up into fused ones;
    `shard` cuts this rank's slice out of each full tensor first."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and model.spec.tie_word_embeddings:
            continue
        target, part = _fused_target(name)
        if target not in params:
            raise ValueError(
                f"checkpoint tensor {name!r} has no place in {model.spec.architecture}"
            )
        param = params[target]
        if shard is not None:
            tensor = shard(name, tensor)
        if part is None:
            _copy(param, tensor, name)
        else:
            module = model.get_submodule(target.rsplit(".", 2)[0])
            sizes = module.shard_sizes()
            start = sum(sizes[:part])
            _copy(param.narrow(0, start, sizes[part]), tensor, name)
        loaded.add(target)
    missing = {n for n in params if n not in loaded}
    if model.spec.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")


def _fused_target(name: str) -> tuple[str, int | None]:
    for fused, part, shard in STACKED_PARAMS:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src)


def fill_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights of realistic scale: N(0, 0.02) matrices, norms near 1, on the model's device."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.uniform_(0.9, 1.1, generator=generator)
        else:
            param.normal_(0.0, 0.02, generator=generator)
