"""A mixture-of-experts MLP layer: the router, the experts stacked per layer, shared experts.

Experts are stacked in two parameters, `gate_up_proj` [experts, 2 x intermediate, hidden]
(each expert's gate rows, then its up rows) and `down_proj` [experts, hidden, intermediate]:
one grouped GEMM reads them. Checkpoints publish one tensor per expert
(`experts.7.gate_proj.weight`; Mixtral's `w1` / `w3` / `w2`); the loaders stack them, and also
take a whole stacked tensor (transformers' in-memory names, our dummy weights).

Parallelism over the node's ranks (`TPGroup`):
- tensor parallel (default): every rank holds every expert's slice of the intermediate
  dimension, like a dense MLP; each computes partial sums for every token;
- expert parallel (`tp.expert_parallel`): rank r holds whole experts
  `[r * E / size, (r + 1) * E / size)` and computes only the (token, expert) pairs routed to
  them. Attention is tensor parallel, so every rank already has every token: no dispatch is
  needed, and one all-reduce combines the partial sums, as with TP.
Shared experts are a tensor-parallel MLP either way; their partial sum joins the experts'
before the one all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.model import ops
from common.model.distributed import TPGroup
from common.model.layers.linear import even_split
from common.model.layers.moe_routing import pairs_by_expert, select_experts
from common.model.layers.weights import copy_checked
from common.model.quantization import fp8_experts
from common.model.quantization.fp8_experts import ExpertScales, Fp8Experts
from common.model.spec import MoESpec

GATE, UP = 0, 1  # shard ids of the gate_up_proj halves


class Router(nn.Module):
    """The gate: `weight` [experts, hidden] (kept whole on every rank, logits accumulated in
    float32), plus DeepSeek-V3's `e_score_correction_bias`. On CUDA one fused kernel
    (`common.model.kernels.moe_router.route`) computes the logits and the choice at every step
    size: on an H200 (128 experts, hidden 2048, top-8) 17.0 / 23.5 / 38.2 us at 256 / 2048 /
    8192 tokens, against 33.1 / 45.6 / 88.9 for the torch ops. Elsewhere `float32_logits` and
    `select_experts`."""

    def __init__(self, moe: MoESpec, hidden_size: int) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        if moe.correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(moe.num_experts, dtype=torch.float32)
            )
        else:
            self.register_parameter("e_score_correction_bias", None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            from common.model.kernels.moe_router import route

            return route(x, self.weight, self.moe, self.e_score_correction_bias)
        logits = float32_logits(x, self.weight)
        return select_experts(logits, self.moe, self.e_score_correction_bias)


def float32_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T accumulated and returned in float32. On CUDA with x and the weight in one
    16-bit dtype: one tensor-core GEMM with a float32 output (`mm`'s out_dtype). A product of two
    16-bit values is exact in float32, so this is the float32 matmul of the same values up to
    the order of the sums, without widening x first (Qwen3-30B-A3B at 8k tokens: the widened
    float32 GEMM took 96 us a layer on an H200). Elsewhere the float32 matmul."""
    if x.is_cuda and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x.float(), weight.float())


class Experts(nn.Module):
    """This rank's experts (all, or its `expert_range` with expert parallelism), each with this
    rank's slice of the intermediate dimension (all of it with expert parallelism). With `quant`
    the weights are FP8 and `gate_up_proj_scale` / `down_proj_scale` hold their scales
    (`common.model.quantization.fp8_experts`)."""

    def __init__(
        self, moe: MoESpec, hidden_size: int, tp: TPGroup, quant: Fp8Experts | None = None
    ) -> None:
        super().__init__()
        self.num_experts, self.tp, self.quant = moe.num_experts, tp, quant
        full = moe.intermediate_size
        if tp.expert_parallel:
            self.expert_range = even_split(moe.num_experts, tp)
            self.columns = range(full)
        else:
            self.expert_range = range(moe.num_experts)
            self.columns = even_split(full, tp)
        experts, size = len(self.expert_range), len(self.columns)
        self.intermediate_size = size
        if quant is not None:
            quant.check(self)
        dtype = quant.weight_dtype if quant is not None else torch.get_default_dtype()
        gate_up = torch.empty(experts, 2 * size, hidden_size, dtype=dtype)
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(experts, hidden_size, size, dtype=dtype),
                                      requires_grad=False)  # fmt: skip
        self.gate_up_proj.weight_loader = self._load_gate_up
        self.down_proj.weight_loader = self._load_down
        if quant is not None:
            quant.create_scales(self, hidden_size)
        self.loaded: set[tuple[str, int, int]] = set()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of every token's routed experts: [T, hidden] in x's dtype."""
        if self.tp.expert_parallel:
            ids = ids - self.expert_range.start  # experts of other ranks fall outside 0..E-1
        scales = self.quant.scales(self) if self.quant is not None else None
        return experts_forward(x, self.gate_up_proj, self.down_proj, weights, ids, scales)

    def finish_loading(self) -> None:
        """After every tensor is in place: FP8 experts from a 16-bit source are quantized."""
        if self.quant is not None:
            self.quant.finish_loading(self)

    def missing(self) -> list[str]:
        """Per-expert checkpoint tensors not loaded yet (`load_weights` reports them)."""
        parts = [("gate_up_proj", GATE), ("gate_up_proj", UP), ("down_proj", 0)]
        if self.quant is not None and self.quant.config.from_checkpoint:
            parts += [("gate_up_proj_scale", GATE), ("gate_up_proj_scale", UP),
                      ("down_proj_scale", 0)]  # fmt: skip
        wanted = {(part, e, shard) for e in self.expert_range for part, shard in parts}
        return [f"expert {e} {p}[{s}]" for p, e, s in sorted(wanted - self.loaded)]

    def load_gate_up_scale(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | None = None
    ) -> None:
        """`shard_id` (expert, GATE or UP): that expert's published gate (up) weight scale."""
        if shard_id is None:
            raise ValueError("is a stacked scale; expected one per expert tensor, as published")
        expert, half = shard_id
        local = self._local(expert)
        if local is not None:
            self.quant.load_gate_up_scale(self, param.data[local], loaded, half)
            self.loaded.add(("gate_up_proj_scale", expert, half))

    def load_down_scale(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | None = None
    ) -> None:
        """`shard_id` (expert, 0): that expert's published down weight scale."""
        if shard_id is None:
            raise ValueError("is a stacked scale; expected one per expert tensor, as published")
        local = self._local(shard_id[0])
        if local is not None:
            self.quant.load_down_scale(self, param.data[local], loaded)
            self.loaded.add(("down_proj_scale", shard_id[0], 0))

    def _local(self, expert: int) -> int | None:
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"names expert {expert} of {self.num_experts}")
        return expert - self.expert_range.start if expert in self.expert_range else None

    def _load_gate_up(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | None = None
    ) -> None:
        """`shard_id` (expert, GATE or UP): that expert's [intermediate, hidden] half; None:
        the whole stacked [experts, 2 x intermediate, hidden] tensor."""
        if shard_id is None:
            for e, both in enumerate(self._stacked(loaded, 2 * self.full_intermediate)):
                gate, up = both.split(self.full_intermediate)
                self._load_gate_up(param, gate, (e, GATE))
                self._load_gate_up(param, up, (e, UP))
            return
        expert, half = shard_id
        local = self._local(expert)
        if local is None:
            return  # another rank's expert
        rows = self.columns
        dst = param.data[local].narrow(0, half * len(rows), len(rows))
        if loaded.dim() != 2 or loaded.shape[0] != self.full_intermediate:
            raise ValueError(
                f"has shape {tuple(loaded.shape)}, expected {self.full_intermediate} rows"
            )
        copy_checked(dst, loaded.narrow(0, rows.start, len(rows)))
        self.loaded.add(("gate_up_proj", expert, half))

    def _load_down(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | None = None
    ) -> None:
        """`shard_id` (expert, 0): that expert's [hidden, intermediate]; None: all stacked."""
        if shard_id is None:
            for e, one in enumerate(self._stacked(loaded, param.shape[1])):
                self._load_down(param, one, (e, 0))
            return
        expert = shard_id[0]
        local = self._local(expert)
        if local is None:
            return
        if loaded.dim() != 2 or loaded.shape[1] != self.full_intermediate:
            raise ValueError(
                f"has shape {tuple(loaded.shape)}, expected {self.full_intermediate} columns"
            )
        cols = self.columns
        copy_checked(param.data[local], loaded.narrow(1, cols.start, len(cols)))
        self.loaded.add(("down_proj", expert, 0))

    @property
    def full_intermediate(self) -> int:
        return len(self.columns) * (1 if self.tp.expert_parallel else self.tp.size)

    def _stacked(self, loaded: torch.Tensor, rows: int) -> torch.Tensor:
        if loaded.dim() != 3 or loaded.shape[0] != self.num_experts or loaded.shape[1] != rows:
            raise ValueError(
                f"has shape {tuple(loaded.shape)}, expected [{self.num_experts}, {rows}, ...] "
                "(stacked experts)"
            )
        return loaded


def experts_forward(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum per token: grouped GEMMs on CUDA
    (`common.model.kernels.fused_moe`, capturable in graphs), the reference elsewhere. With
    `scales` the weights are FP8 and the experts compute W8A8 (`fp8_experts`)."""
    if x.is_cuda:
        from common.model.kernels import fused_moe

        return fused_moe.experts_forward(x, gate_up, down, weights, ids, scales=scales)
    if scales is not None:
        return fp8_experts.reference(x, gate_up, down, scales, weights, ids)
    return experts_reference(x, gate_up, down, weights, ids)


def experts_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """Every (token, expert) pair with 0 <= id < experts, one expert at a time, summed in
    float32: the CPU path and the oracle of the GPU kernels. Ids outside (other ranks'
    experts under expert parallelism) contribute nothing."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    for expert, token, slot in pairs_by_expert(ids, gate_up.shape[0]):
        hidden = F.linear(x[token], gate_up[expert])
        hidden = ops.silu_and_mul(hidden)
        y = F.linear(hidden, down[expert]).float()
        out.index_add_(0, token, y * weights[token, slot].unsqueeze(-1).float())
    return out.to(x.dtype)


class MoEBlock(nn.Module):
    """Route, run the chosen experts and any shared experts, all-reduce once."""

    input_quant = None  # the router and the experts take the plain hidden state

    def __init__(
        self,
        moe: MoESpec,
        hidden_size: int,
        tp: TPGroup,
        shared: nn.Module | None,
        quant: Fp8Experts | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.gate = Router(moe, hidden_size)
        self.experts = Experts(moe, hidden_size, tp, quant)
        self.shared_experts = shared  # a tensor-parallel MLP that does not reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)
