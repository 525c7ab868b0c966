"""The collectives a tensor-parallel rank needs, over `torch.distributed`.

`TPGroup` wraps two process groups of the node's ranks: `device_group` for tensors on the
model's device (NCCL on CUDA, gloo on CPU), `cpu_group` (gloo) for the host-side step metadata
rank 0 broadcasts (`common.engine.tp_link`). With one rank every collective is a no-op, so the model
code calls them unconditionally. On CUDA the device collectives are NCCL calls on the current
stream, which CUDA graphs capture: a captured decode step replays its all-reduces.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from common.model.parallel import TPLayout

log = logging.getLogger(__name__)

INIT_TIMEOUT = datetime.timedelta(minutes=10)  # weights of a large model load before the 1st


class TPGroup:
    """`expert_parallel`: mixture-of-experts layers put whole experts on ranks instead of
    splitting every expert (`common.model.layers.moe`); attention stays tensor parallel."""

    def __init__(
        self, rank: int, size: int, device_group=None, cpu_group=None, expert_parallel=False
    ) -> None:
        self.rank, self.size = rank, size
        self.device_group, self.cpu_group = device_group, cpu_group
        self.expert_parallel = expert_parallel

    @classmethod
    def single(cls) -> TPGroup:
        return cls(0, 1)

    @classmethod
    def init(
        cls,
        rank: int,
        size: int,
        init_method: str,
        device: torch.device,
        expert_parallel: bool = False,
    ) -> TPGroup:
        """Join the node's process group (every rank calls this with the same address)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=INIT_TIMEOUT,
            device_id=device if device.type == "cuda" else None,
        )
        cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
        log.info("tensor-parallel rank %d/%d joined (%s)", rank, size, backend)
        return cls(rank, size, dist.group.WORLD, cpu_group, expert_parallel)

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules; the others follow its steps."""
        return self.rank == 0

    def layout(self, spec) -> TPLayout:
        return TPLayout.of(spec, self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (graph-capturable on NCCL); returns `x`."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, n] on every rank -> [rows, size * n], rank r's columns at r * n."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        if x.is_cuda:
            dist.all_gather_into_tensor(parts, x, group=self.device_group)
        else:  # gloo has no all_gather_into_tensor
            dist.all_gather(list(parts.unbind(0)), x, group=self.device_group)
        return parts.permute(1, 0, 2).reshape(x.shape[0], -1)

    def broadcast(self, x: torch.Tensor, cpu: bool = False) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype everywhere), in place."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.cpu_group if cpu else self.device_group)
        return x

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's `obj` (picklable), in rank order; over the gloo group, once at start
        (the decode ranks' KV pool exports, `kv_transfer.tp`)."""
        if self.size == 1:
            return [obj]
        out: list[object] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (ranks size their KV pools alike)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def close(self) -> None:
        """Leave the group. After NCCL collectives were captured in CUDA graphs,
        `destroy_process_group` can hang (pytorch/pytorch#115388); the process is about to
        exit then, which releases the communicators anyway, so NCCL groups are left as they
        are."""
        if self.size > 1 and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
