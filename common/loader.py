"""Find a checkpoint, read its spec, build our model and fill its weights.

Sources: an HF directory (config.json + *.safetensors, sharded or not), a hub id (`org/name`)
whose snapshot is in the local Hugging Face cache (`common/hub.py`), a GGUF file (through
transformers, converted once to the serving dtype and cached as an HF directory), the embedded
SmolLM2 GGUF when no model is named, or `load_format="dummy"`: random weights from a
config.json alone, for benchmarks.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from common.distributed import TPGroup
from common.embedded import embedded_gguf_path
from common.gguf_cache import materialize_gguf
from common.hub import ModelNotFound, cached_snapshot, looks_like_hub_id
from common.model_spec import ModelSpec
from common.models.llama import STACKED_PARAMS, LlamaForCausalLM
from common.parallel import TPLayout, rank_spec
from common.sharding import Sharder, dummy_full_tensors

log = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class ModelSource:
    """A resolved checkpoint: an HF-style directory (for GGUF, the cached conversion)."""

    directory: Path
    name: str  # what /v1/models reports


def resolve_model(model: str | None, dtype: str = "float32") -> ModelSource:
    """The checkpoint `model` names. `dtype` is the serving dtype: a GGUF file is converted to
    it (once per file and dtype). Raises `ModelNotFound` (a ValueError) with one line that says
    where it looked and what to do."""
    if model is None:
        gguf = embedded_gguf_path()
        return ModelSource(materialize_gguf(gguf, dtype), "SmolLM2-135M-Instruct")
    path = Path(model).expanduser()
    name = path.name
    if not path.exists() and looks_like_hub_id(model):
        path, name = cached_snapshot(model), model
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(materialize_gguf(path, dtype), path.stem)
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if not path.is_dir():
        raise ModelNotFound(
            f"model {model!r} is not a directory, a config.json, a .gguf file or a hub id "
            "(org/name) in the Hugging Face cache"
        )
    if not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return ModelSource(materialize_gguf(ggufs[0], dtype), name)
        raise ModelNotFound(f"model directory {path} has no config.json")
    return ModelSource(path, name)


def read_spec(source: ModelSource) -> ModelSpec:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source.directory)
    return ModelSpec.from_hf_config(config, eos_token_ids=_generation_eos_ids(source.directory))


def _generation_eos_ids(directory: Path) -> tuple[int, ...]:
    path = directory / "generation_config.json"
    if not path.exists():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(eos)


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
