"""The paged KV pool: one allocation, viewed per layer as K and V blocks.

Layout `[num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim]`, so layer l's K is
the contiguous view `[num_blocks + 1, block_size, num_kv_heads, head_dim]`. One allocation means
one CUDA IPC handle exports the whole pool to a prefill node. The extra last block belongs to no
sequence: padding rows of a captured CUDA-graph batch write their KV there (`padding_slot`),
so a captured step needs no data-dependent branch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.model.spec import ModelSpec

DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass
class KVCache:
    pool: torch.Tensor
    block_size: int

    @classmethod
    def allocate(
        cls,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        shape = (spec.num_layers, 2, num_blocks + 1, block_size, spec.num_kv_heads, spec.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), block_size)

    @property
    def num_blocks(self) -> int:
        """Blocks the allocator may hand out (the padding block excluded)."""
        return self.pool.shape[2] - 1

    @property
    def padding_slot(self) -> int:
        return self.num_blocks * self.block_size

    def __post_init__(self) -> None:
        # Per-layer views, made once: the prefill graphs index them on every layer of a step.
        layers = range(self.pool.shape[0])
        self.k_caches: list[torch.Tensor] = [self.pool[layer, 0] for layer in layers]
        self.v_caches: list[torch.Tensor] = [self.pool[layer, 1] for layer in layers]


def block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    return spec.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * block_size


def num_blocks_for_budget(
    spec: ModelSpec, block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    n = budget_bytes // block_bytes(spec, block_size, dtype) - 1  # one padding block
    if n < 1:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes holds no block of {block_bytes(spec, block_size, dtype)} bytes"
        )
    return int(n)


def gpu_kv_budget(device: torch.device, memory_fraction: float) -> int:
    """Bytes left for KV once weights and the peak activations of a warm-up are accounted for."""
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    peak = torch.cuda.max_memory_allocated(device)
    budget = int(total * memory_fraction) - used_by_others - peak
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: total {total}, fraction {memory_fraction}, "
            f"peak use {peak}, other processes {used_by_others}"
        )
    return budget
