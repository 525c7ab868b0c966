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
from common.model.layers.linear import process_weights_after_loading
from common.model.parallel import StageLayers
from common.model.quantization.selection import linear_method_for
from common.model.registry import CausalLM, model_class
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
    quantization: str = "auto",
    stage: StageLayers | None = None,
) -> CausalLM:
    """The model of `spec` (the full model's) for rank `tp.rank` of `tp.size`, its layers
    cutting their slices out of the full checkpoint tensors (or full dummy tensors); `stage`:
    the layers of one pipeline stage (default: all). `quantization`: "auto" (as the
    checkpoint is stored) or "fp8" (quantize at load)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    tp = tp or TPGroup.single()
    cls = model_class(spec.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            method = linear_method_for(spec, quantization, load_format)
            model = cls(spec, max_positions, tp, method, stage)
    finally:
        torch.set_default_dtype(previous)
    if torch.device(device).type == "meta":
        return model.eval()  # shapes only, no memory: for sizing a model (parameter counts)
    with torch.no_grad():
        if load_format == "dummy" and tp.size == 1 and model.stage.is_whole:
            fill_dummy_weights(model, seed)
        elif load_format == "dummy":
            model.load_weights(dummy_full_tensors(cls, spec, max_positions, seed, dtype, device))
        else:
            model.load_weights(iter_safetensors(source.directory))
        process_weights_after_loading(model)
    return model.eval()


def _safetensors_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors files in {directory} (use load_format='dummy' for random weights)"
        )
    return files


def safetensors_names(directory: Path) -> list[str]:
    """The tensor names of a checkpoint, without reading the tensors."""
    from safetensors import safe_open

    names: list[str] = []
    for file in _safetensors_files(directory):
        with safe_open(str(file), framework="pt") as handle:
            names.extend(handle.keys())
    return names


def iter_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = _safetensors_files(directory)
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


def fill_dummy_weights(model: CausalLM, seed: int) -> None:
    """Random weights of realistic scale: N(0, 0.02) matrices, norms near 1, on the model's device."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        _draw(name, param, generator)


def dummy_full_tensors(
    cls: type[CausalLM],
    spec: ModelSpec,
    max_positions: int,
    seed: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights `fill_dummy_weights` gives a single-rank model of `spec`, one full tensor
    at a time in our names (fused ones whole): the same draws, so TP n equals TP 1."""
    with torch.device("meta"):
        full = cls(spec, max_positions)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, meta in full.named_parameters():
        tensor = torch.empty(meta.shape, dtype=dtype, device=device)
        _draw(name, tensor, generator)
        yield name, tensor


def _draw(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    if "norm" in name:
        tensor.uniform_(0.9, 1.1, generator=generator)
    else:
        tensor.normal_(0.0, 0.02, generator=generator)
