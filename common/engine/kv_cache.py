"""The paged KV pool: one allocation, viewed per layer as K and V blocks (or MLA latents).

Layout `[num_layers, planes, num_blocks + 1, block_size, heads, head_dim]` from the model's
`KVCacheGeometry`: planes 2 (K, V) of num_kv_heads x head_dim, so layer l's K is the
contiguous view `[num_blocks + 1, block_size, num_kv_heads, head_dim]` (`k_caches`); for
DeepSeek's MLA one plane of one "head" of kv_lora_rank + qk_rope_head_dim values, the
`[latent | k_pe]` row every query head reads (`latent_caches`). One allocation means
one CUDA IPC handle exports the whole pool to a prefill node. The extra last block belongs to no
sequence: padding rows of a captured CUDA-graph batch write their KV there (`padding_slot`),
so a captured step needs no data-dependent branch.

A pipeline stage's pool holds only its layers (`first_layer` on): the per-layer views stay
indexed by the model's layer number (None below `first_layer`), so attention is unchanged.

`--kv-cache-dtype fp8` stores K and V as float8_e4m3fn with one scale per layer for K and one
for V (an MLA pool's one plane uses the K scales): stored = clamp(x / scale, -448, 448), read =
stored * scale. Scales come from the checkpoint (`self_attn.k_scale` / `v_scale`), else 1.0:
Llama-family K and V (and DeepSeek's normalized latents) stay far inside +-448, and a value
beyond saturates rather than overflowing. A pool in the model dtype ignores
them, and its attention calls are exactly those of a model without FP8 KV.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from dataclasses import dataclass, field

import torch

from common.engine.config import KV_CACHE_DTYPES
from common.model.spec import ModelSpec

DEFAULT_CPU_KV_BYTES = 1 << 30
# A CUDA context, cuBLAS and NCCL outside PyTorch's allocator, where nvidia-smi cannot say.
NON_TORCH_BYTES = 1 << 30
FP8_KV_DTYPE = torch.float8_e4m3fn


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for `--kv-cache-dtype`: auto is the model dtype."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    return FP8_KV_DTYPE if name == "fp8" else model_dtype


@dataclass
class KVCache:
    pool: torch.Tensor
    block_size: int
    # Per layer (FP8 pools only read them): x = stored * scale. Empty means 1.0 for every layer.
    k_scales: list[float] = field(default_factory=list)
    v_scales: list[float] = field(default_factory=list)
    first_layer: int = 0  # the model layer of pool layer 0 (a pipeline stage's first)

    @classmethod
    def allocate(
        cls,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        k_scales: list[float] | None = None,
        v_scales: list[float] | None = None,
        layers: range | None = None,
    ) -> KVCache:
        """`layers`: the model layers this pool holds (a pipeline stage's; default all)."""
        g = spec.kv_cache_geometry
        layers = layers if layers is not None else range(spec.num_layers)
        shape = (len(layers), g.planes, num_blocks + 1, block_size, g.heads, g.head_dim)
        pool = torch.zeros(shape, dtype=dtype, device=device)
        return cls(pool, block_size, list(k_scales or []), list(v_scales or []), layers.start)

    @property
    def layers(self) -> range:
        """The model layers this pool holds (pool layer i is model layer first_layer + i)."""
        return range(self.first_layer, self.first_layer + self.pool.shape[0])

    @property
    def num_blocks(self) -> int:
        """Blocks the allocator may hand out (the padding block excluded)."""
        return self.pool.shape[2] - 1

    @property
    def padding_slot(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def is_fp8(self) -> bool:
        return self.pool.dtype == FP8_KV_DTYPE

    @property
    def is_latent(self) -> bool:
        """One plane: DeepSeek's MLA latent rows."""
        return self.pool.shape[1] == 1

    def context_kwargs(self) -> dict[str, list]:
        """The arguments of every `ForwardContext` over this pool beyond its K/V caches: an MLA
        pool's latent caches; the per-layer scales of an FP8 pool (none in the model dtype)."""
        k, v = self._scales_by_layer
        if self.is_latent:
            return {"latent_caches": self.latent_caches} | (
                {"latent_scales": k} if self.is_fp8 else {}
            )
        if not self.is_fp8:
            return {}
        return {"k_scales": k, "v_scales": v}

    def __post_init__(self) -> None:
        num_layers = self.pool.shape[0]
        for name in ("k_scales", "v_scales"):
            scales = getattr(self, name) or [1.0] * num_layers
            bad = [s for s in scales if not (math.isfinite(s) and s > 0)]
            if len(scales) != num_layers or bad:
                raise ValueError(
                    f"{name} must be {num_layers} positive finite floats, got {len(scales)} "
                    f"with {bad[:4]} bad"
                )
            setattr(self, name, [float(s) for s in scales])
        # Scales indexed by model layer, like the caches (1.0 for other stages' layers).
        skipped = [1.0] * self.first_layer
        self._scales_by_layer = (skipped + self.k_scales, skipped + self.v_scales)
        # Per-layer views, made once: the prefill graphs index them on every layer of a step.
        layers = range(num_layers)
        skipped: list = [None] * self.first_layer  # other pipeline stages' layers
        first = skipped + [self.pool[layer, 0] for layer in layers]
        self.latent_caches: list[torch.Tensor] = first if self.is_latent else []
        self.k_caches: list[torch.Tensor] = [] if self.is_latent else first
        self.v_caches: list[torch.Tensor] = (
            [] if self.is_latent else skipped + [self.pool[layer, 1] for layer in layers]
        )


def block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """K and V (or MLA latents) of every layer of `spec` for one block, in the pool's dtype (an
    FP8 block: half bf16's). A pipeline stage passes a spec of its layers only."""
    return spec.kv_bytes_per_token(dtype.itemsize) * block_size


def num_blocks_for_budget(
    spec: ModelSpec,
    block_size: int,
    dtype: torch.dtype,
    budget_bytes: int,
    extra_block_bytes: int = 0,
) -> int:
    """Blocks of `spec`'s pool that fit `budget_bytes`; `extra_block_bytes`: what each block
    also costs elsewhere (a speculative proposer's pool of the same blocks)."""
    per_block = block_bytes(spec, block_size, dtype) + extra_block_bytes
    n = budget_bytes // per_block - 1  # one padding block
    if n < 1:
        raise ValueError(f"KV budget of {budget_bytes} bytes holds no block of {per_block} bytes")
    return int(n)


@dataclass(frozen=True)
class GpuMemory:
    """One process's GPU memory once its weights are loaded and its largest step ran once."""

    total: int  # the device's memory
    free: int  # free on the device now; other processes use total - free - held
    own: int  # needed besides KV and graphs: weights, the step's peak, the CUDA context
    held: int  # held now: own less the activations the step freed


def measure_gpu_memory(device: torch.device) -> GpuMemory:
    """This process's use, read right after `memory_probe.step_peak_bytes` (whose peak
    statistic it reads). Memory outside PyTorch's allocator (CUDA context, NCCL) comes from
    nvidia-smi's per-process figure where it lists this process, else `NON_TORCH_BYTES`."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    peak = torch.cuda.max_memory_allocated(device)
    process = _process_gpu_bytes(device)
    non_torch = NON_TORCH_BYTES if process is None else max(0, process - reserved)
    return GpuMemory(total, free, max(peak, reserved) + non_torch, reserved + non_torch)


def gpu_kv_budget(memory: GpuMemory, fraction: float, graph_bytes: int) -> int:
    """KV bytes for a process that may use `fraction` of its GPU's total memory: that share
    less its own use and the CUDA graphs it will capture. Other processes do not count, so
    processes sharing a GPU each get their own share; ValueError when the share cannot hold
    this process without KV, or when the rest of it is not free (the shares on this GPU sum
    past 1)."""
    share = int(memory.total * fraction)
    budget = share - memory.own - graph_bytes
    if budget <= 0:
        raise ValueError(
            f"--gpu-memory-fraction {fraction:g} allows {_gb(share)} of this GPU's "
            f"{_gb(memory.total)}, no more than the {_gb(memory.own + graph_bytes)} this "
            f"process needs before any KV cache (weights, activations and CUDA context "
            f"{_gb(memory.own)}, CUDA graphs {_gb(graph_bytes)}): raise the fraction"
        )
    still_needed = share - memory.held
    if still_needed > memory.free:
        others = memory.total - memory.free - memory.held
        raise ValueError(
            f"--gpu-memory-fraction {fraction:g} allows {_gb(share)} of this GPU's "
            f"{_gb(memory.total)}; this process holds {_gb(memory.held)} and the rest, "
            f"{_gb(still_needed)}, is not free ({_gb(memory.free)}: other processes use "
            f"{_gb(others)}): the fractions of the processes sharing a GPU must sum to at most 1"
        )
    return budget


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _process_gpu_bytes(device: torch.device) -> int | None:
    """This process's memory on `device` as nvidia-smi lists it (None where it is missing, or
    lists no such process: another PID namespace, MIG)."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = "--query-compute-apps=pid,gpu_uuid,used_memory"
    try:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))
    for line in out.splitlines():
        pid, gpu, mib = (part.strip() for part in (line.split(",") + ["", ""])[:3])
        mine = pid == str(os.getpid()) and (not uuid or gpu.lower().endswith(uuid.lower()))
        if mine and mib.isdigit():
            return int(mib) << 20
    return None
