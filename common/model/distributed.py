"""The collectives a tensor-parallel rank needs, and the point-to-point links between the
pipeline stages of a node, over `torch.distributed`.

`TPGroup` wraps two process groups of the node's ranks: `device_group` for tensors on the
model's device (NCCL on CUDA, gloo on CPU), `cpu_group` (gloo) for the host-side step metadata
rank 0 broadcasts (`common.engine.tp_link`). With one rank every collective is a no-op, so the model
code calls them unconditionally. On CUDA the device collectives are NCCL calls on the current
stream, which CUDA graphs capture: a captured decode step replays its all-reduces.

Pipeline parallel (`init_node_groups`): a node of pp stages x tp ranks is one world of pp * tp
processes, global rank = stage * tp + tp rank. Each stage's ranks form their own `TPGroup`
(its `root` is the stage's first global rank); `PipeGroup` links tp rank r of stage s to tp
rank r of stages s - 1 and s + 1 (hidden states, over the device backend), stage leaders to
each other (step metadata, gloo), and the last stage's leader to global rank 0 (the logits of
the rows rank 0 samples).
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from common.model.parallel import PPLayout, TPLayout

log = logging.getLogger(__name__)

INIT_TIMEOUT = datetime.timedelta(minutes=10)  # weights of a large model load before the 1st


class TPGroup:
    """`expert_parallel`: mixture-of-experts layers put whole experts on ranks instead of
    splitting every expert (`common.model.layers.moe`); attention stays tensor parallel."""

    def __init__(
        self,
        rank: int,
        size: int,
        device_group=None,
        cpu_group=None,
        expert_parallel=False,
        root: int = 0,
    ) -> None:
        self.rank, self.size = rank, size
        self.device_group, self.cpu_group = device_group, cpu_group
        self.expert_parallel = expert_parallel
        self.root = root  # the global rank of this group's rank 0 (pipeline stages: s * tp)

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
            dist.broadcast(x, src=self.root, group=self.cpu_group if cpu else self.device_group)
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
        close_world(self.size)


def close_world(size: int) -> None:
    if size > 1 and dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()


class PipeGroup:
    """This rank's links to the neighbouring pipeline stages. Every send is asynchronous (the
    returned work must outlive its tensor); receives block until the tensor is in."""

    def __init__(
        self,
        layout: PPLayout,
        stage: int,
        tp_rank: int,
        tp_size: int,
        device_group,
        cpu_group,
        device: torch.device,
    ) -> None:
        self.layout, self.stage, self.tp_rank, self.tp_size = layout, stage, tp_rank, tp_size
        self.device_group, self.cpu_group, self.device = device_group, cpu_group, device
        self.rank = stage * tp_size + tp_rank

    @property
    def size(self) -> int:
        return self.layout.size

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.layout.size - 1

    @property
    def layers(self) -> range:
        return self.layout.layers(self.stage)

    def _peer(self, stage: int, tp_rank: int | None = None) -> int:
        return stage * self.tp_size + (self.tp_rank if tp_rank is None else tp_rank)

    def send_next(self, tensors: list[torch.Tensor], cpu: bool = False) -> list:
        """To the same tp rank of the next stage (`cpu`: leader to leader, step metadata)."""
        group = self.cpu_group if cpu else self.device_group
        dst = self._peer(self.stage + 1)
        return [dist.isend(t, dst, group=group) for t in tensors]

    def recv_prev(self, tensors: list[torch.Tensor], cpu: bool = False) -> list[torch.Tensor]:
        group = self.cpu_group if cpu else self.device_group
        src = self._peer(self.stage - 1)
        for work in [dist.irecv(t, src, group=group) for t in tensors]:
            work.wait()
        return tensors

    def send_to_driver(self, x: torch.Tensor):
        """The last stage's leader: a step's logits rows to global rank 0, which samples."""
        return dist.isend(x, 0, group=self.device_group)

    def recv_from_last(self, x: torch.Tensor):
        """Rank 0: post the receive of a step's logits rows from the last stage's leader."""
        return dist.irecv(x, self._peer(self.layout.size - 1, 0), group=self.device_group)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value`, over all stages (one block count for all)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


def init_node_groups(
    rank: int,
    tp: int,
    layout: PPLayout,
    init_method: str,
    device: torch.device,
    expert_parallel: bool = False,
) -> tuple[TPGroup, PipeGroup]:
    """Join a pipelined node's world (every rank calls this with the same address): this
    rank's stage `TPGroup` and its `PipeGroup`. Every rank creates every group, in one order,
    as `new_group` requires."""
    pp = layout.size
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=tp * pp,
        timeout=INIT_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )
    world_cpu = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    stage, tp_rank = divmod(rank, tp)
    mine = (None, None)
    for s in range(pp):
        ranks = list(range(s * tp, (s + 1) * tp))
        device_group = dist.new_group(ranks)
        cpu_group = dist.new_group(ranks, backend="gloo") if backend == "nccl" else device_group
        if s == stage:
            mine = (device_group, cpu_group)
    log.info("pipeline stage %d/%d, tensor-parallel rank %d/%d joined (%s)",
             stage, pp, tp_rank, tp, backend)  # fmt: skip
    group = TPGroup(tp_rank, tp, *mine, expert_parallel, root=stage * tp)
    pipe = PipeGroup(layout, stage, tp_rank, tp, dist.group.WORLD, world_cpu, device)
    return group, pipe
