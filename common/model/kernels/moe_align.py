"""Mixture-of-experts routing plan: the (token, slot) pairs of `topk_ids` sorted by expert.

Pair p = t * k + j routes token t through expert `topk_ids[t, j]`. The plan lays the pairs out
as rows, grouped by expert in expert order (within an expert, by pair index), each expert's
group padded to a multiple of `block_m` so that every `block_m` rows belong to one expert.
Shapes depend only on (T, k, E, block_m), never on the ids, and the kernels read the ids on
the device, so building a plan never syncs with the host and is CUDA-graph capturable.

An id outside [0, E) (e.g. -1 for an expert that lives on another rank) drops its pair: it has
no row and `pair_rows` holds -1 for it.

One program of `ONE_PROGRAM_WARPS` warps does everything up to `ONE_PROGRAM_PAIRS` pairs
(decode: one launch); beyond, two launches: per-program expert counts (each program also
fills a share of `sorted_pairs` with the no-pair sentinel), then per-program placement, each
placing program summing all the counts itself and writing a share of the layout. The fill
moved out of the placement (it wrote each expert's padding and the tail there) took a 2048-token
Qwen3-30B-A3B plan from 14.0 to 11.3 us on an H200 (2026-11-26, `docs/benchmarks.md`).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from common.model.kernels.pdl import pdl_args, pdl_prologue

# Up to this many pairs one launch builds the plan. H200, Qwen3-30B-A3B (k = 8, 128 experts):
# one launch 6.2 / 5.8 / 9.7 / 16.4 us at 8 / 64 / 128 / 256 pairs, two 7.0 / 7.0 / 10.6 /
# 10.4. DeepSeek-V2-Lite (64 experts) takes two launches better from 6 pairs (6.7 against 8.8
# us), but its plans start at 5 tokens (30 pairs; the GEMVs need none), where it loses ~2 us.
ONE_PROGRAM_PAIRS = 128
ONE_PROGRAM_WARPS = 8
# Beyond: pairs each counting / placing program owns, at least PAIRS_PER_PROGRAM and doubled
# until at most MAX_PROGRAMS programs run: every placing program reads all programs' counts.
# H200, Qwen3-30B-A3B: 9.2 / 15.0 / 27.0 us at 1024 / 16384 / 65536 pairs (128, 128 and
# 256 pairs a program), against 21.8 / 25.6 / 45.1 for three launches (256 a program).
PAIRS_PER_PROGRAM = 128
MAX_PROGRAMS = 256
_TILE = 1024  # rows per store when filling the tail past the last expert


@dataclasses.dataclass(frozen=True)
class MoEPlan:
    """Device tensors (int32) of one routing plan; `num_rows` = len(sorted_pairs).

    sorted_pairs [num_rows]: the pair held by each row, or `num_pairs` for a row holding none
      (an expert's padding, or the tail past the last expert's group).
    block_expert [num_rows // block_m]: the expert owning each block of rows, -1 for a block
      holding no pair (always the tail: the experts' groups come first).
    pair_rows [num_pairs]: the row of each pair, -1 if its id is outside [0, E).
    expert_ends [E]: the end row of each expert's padded group (with block_m = 1: the
      cumulative counts, `torch._grouped_mm`'s `offs`).
    """

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    pair_rows: torch.Tensor
    expert_ends: torch.Tensor
    num_pairs: int
    top_k: int
    block_m: int

    @property
    def num_rows(self) -> int:
        return self.sorted_pairs.shape[0]


def max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of any plan: every pair, plus < block_m padding for each expert that has a pair."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, one_program: bool | None = None
) -> MoEPlan:
    """The plan of `topk_ids` [T, k] (int32 or int64) over `num_experts` experts, in one launch
    or three (`one_program` None: one up to `ONE_PROGRAM_PAIRS` pairs)."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"topk_ids must be [T, k] int32 or int64, got {topk_ids.dtype} {tuple(topk_ids.shape)}"
        )
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"num_experts and block_m must be >= 1, got {num_experts}, {block_m}")
    ids = topk_ids.contiguous()
    num_pairs, device = ids.numel(), ids.device
    rows = max_rows(num_pairs, num_experts, block_m)
    blocks = rows // block_m
    plan = MoEPlan(
        sorted_pairs=torch.empty(rows, dtype=torch.int32, device=device),
        block_expert=torch.empty(blocks, dtype=torch.int32, device=device),
        pair_rows=torch.empty(num_pairs, dtype=torch.int32, device=device),
        expert_ends=torch.empty(num_experts, dtype=torch.int32, device=device),
        num_pairs=num_pairs,
        top_k=ids.shape[1],
        block_m=block_m,
    )
    e_pad = triton.next_power_of_2(num_experts)
    sub = max(16, min(128, 8192 // e_pad))  # [SUB, E_PAD] one-hot tiles of <= 8192 ints
    tiles = dict(E_PAD=e_pad, BLOCK_M=block_m, BM_PAD=triton.next_power_of_2(block_m), BT=sub)
    layout = (plan.sorted_pairs, plan.expert_ends, plan.block_expert, num_pairs, blocks)
    if one_program is None:
        one_program = num_pairs <= ONE_PROGRAM_PAIRS
    if one_program:
        _align_kernel[(1,)](
            ids, plan.pair_rows, *layout, rows, num_experts, **tiles, SUB=sub, TILE=_TILE,
            num_warps=ONE_PROGRAM_WARPS, **pdl_args(device),
        )  # fmt: skip
        return plan
    per = max(PAIRS_PER_PROGRAM, triton.next_power_of_2(triton.cdiv(num_pairs, MAX_PROGRAMS)))
    programs = triton.cdiv(num_pairs, per)
    partial = torch.empty(programs, e_pad, dtype=torch.int32, device=device)
    fill = triton.cdiv(triton.cdiv(rows, programs), _TILE) * _TILE  # sentinel rows a program
    _count_kernel[(programs,)](
        ids, partial, plan.sorted_pairs, num_pairs, rows, per, fill, num_experts, E_PAD=e_pad,
        SUB=sub, TILE=_TILE, **pdl_args(device),
    )  # fmt: skip
    _place_kernel[(programs,)](
        ids, partial, plan.pair_rows, *layout, num_experts, per, **tiles, SUB=sub,
        **pdl_args(device),
    )  # fmt: skip
    return plan


@triton.jit
def _one_hot(ids_ptr, start, hi, E, E_PAD: tl.constexpr, SUB: tl.constexpr):
    """Pairs [start, start + SUB) clipped to hi: their indices, expert ids (-1 past hi or
    outside [0, E)) and one-hot [SUB, E_PAD] int32 rows (all zero for -1)."""
    pairs = start + tl.arange(0, SUB)
    ids = tl.load(ids_ptr + pairs, mask=pairs < hi, other=-1).to(tl.int32)
    ids = tl.where((ids >= 0) & (ids < E), ids, -1)
    hot = (ids[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)
    return pairs, ids, hot


@triton.jit
def _count_pairs(ids_ptr, lo, hi, E, E_PAD: tl.constexpr, SUB: tl.constexpr):
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(lo, hi, SUB):
        _, _, hot = _one_hot(ids_ptr, start, hi, E, E_PAD, SUB)
        counts += tl.sum(hot, axis=0)
    return counts


@triton.jit
def _place_pairs(ids_ptr, sorted_ptr, pair_rows_ptr, lo, hi, E, next_row,
                 E_PAD: tl.constexpr, SUB: tl.constexpr):  # fmt: skip
    """Pairs [lo, hi) in order into the rows `next_row[e]` onwards of their expert."""
    offs = tl.arange(0, SUB)
    for start in range(lo, hi, SUB):
        pairs, ids, hot = _one_hot(ids_ptr, start, hi, E, E_PAD, SUB)
        earlier_same = (ids[:, None] == ids[None, :]) & (offs[None, :] < offs[:, None])
        row = tl.sum(hot * next_row[None, :], axis=1) + tl.sum(earlier_same.to(tl.int32), axis=1)
        routed = ids >= 0
        tl.store(sorted_ptr + row, pairs, mask=routed)
        tl.store(pair_rows_ptr + pairs, tl.where(routed, row, -1), mask=pairs < hi)
        next_row += tl.sum(hot, axis=0)


@triton.jit
def _groups(counts, BLOCK_M: tl.constexpr):
    """From the experts' pair counts: each group's first row, padded size and end row, and
    the rows in all groups."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    return ends - padded, padded, ends, tl.sum(padded, axis=0)


@triton.jit
def _layout(counts, sorted_ptr, ends_ptr, block_expert_ptr, num_pairs, num_blocks, E,
            part, parts, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BM_PAD: tl.constexpr,
            BT: tl.constexpr, PADS: tl.constexpr):  # fmt: skip
    """Writes part `part` of `parts` of the layout: expert_ends (part 0), with PADS (one part:
    the one-program plan) every expert's padding rows' sentinel, and block_expert (every
    parts-th tile of BT blocks). Returns (first rows [E_PAD], rows in all groups)."""
    experts = tl.arange(0, E_PAD)
    starts, padded, ends, total = _groups(counts, BLOCK_M)
    if part == 0:
        tl.store(ends_ptr + experts, ends, mask=experts < E)
    if PADS:
        pads = tl.arange(0, BM_PAD)[None, :]
        pad_rows = (starts + counts)[:, None] + pads
        tl.store(sorted_ptr + pad_rows, num_pairs, mask=pads < (padded - counts)[:, None])
    # A block's owner: the first expert whose group ends past its first row (experts >= E
    # count nothing, so their ends equal `total`).
    for b0 in range(part * BT, num_blocks, parts * BT):
        blocks = b0 + tl.arange(0, BT)
        first = blocks * BLOCK_M
        owner = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(first < total, owner, -1), mask=blocks < num_blocks)  # fmt: skip
    return starts, total


@triton.jit
def _fill_sentinel(sorted_ptr, lo, hi, step, num_pairs, TILE: tl.constexpr):
    for start in range(lo, hi, step):
        rows = start + tl.arange(0, TILE)
        tl.store(sorted_ptr + rows, num_pairs, mask=rows < hi)


@triton.jit
def _align_kernel(ids_ptr, pair_rows_ptr, sorted_ptr, ends_ptr, block_expert_ptr,
                  num_pairs, num_blocks, num_rows, E,
                  E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BM_PAD: tl.constexpr,
                  BT: tl.constexpr, SUB: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_prologue(PDL)
    counts = _count_pairs(ids_ptr, 0, num_pairs, E, E_PAD, SUB)
    starts, total = _layout(counts, sorted_ptr, ends_ptr, block_expert_ptr, num_pairs,
                            num_blocks, E, 0, 1, E_PAD, BLOCK_M, BM_PAD, BT, True)  # fmt: skip
    _place_pairs(ids_ptr, sorted_ptr, pair_rows_ptr, 0, num_pairs, E, starts, E_PAD, SUB)
    _fill_sentinel(sorted_ptr, total, num_rows, TILE, num_pairs, TILE)


@triton.jit
def _count_kernel(ids_ptr, partial_ptr, sorted_ptr, num_pairs, num_rows, per_program,
                  fill_per_program, E, E_PAD: tl.constexpr, SUB: tl.constexpr,
                  TILE: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """partial[p] = expert counts of program p's pairs; sorted rows [p * fill, (p + 1) * fill)
    get the no-pair sentinel (the placement overwrites the rows that hold pairs)."""
    pdl_prologue(PDL)
    p = tl.program_id(0)
    lo = p * per_program
    hi = tl.minimum(lo + per_program, num_pairs)
    counts = _count_pairs(ids_ptr, lo, hi, E, E_PAD, SUB)
    tl.store(partial_ptr + p * E_PAD + tl.arange(0, E_PAD), counts)
    first = p * fill_per_program
    _fill_sentinel(sorted_ptr, first, tl.minimum(first + fill_per_program, num_rows), TILE,
               num_pairs, TILE)  # fmt: skip


@triton.jit
def _place_kernel(ids_ptr, partial_ptr, pair_rows_ptr, sorted_ptr, ends_ptr, block_expert_ptr,
                  num_pairs, num_blocks, E, per_program,
                  E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BM_PAD: tl.constexpr,
                  BT: tl.constexpr, SUB: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """Program p sums every program's counts (a few KB from L2: cheaper than a launch of
    one program that would hand out the offsets), writes its share of the layout (no padding:
    `_count_kernel` filled every row) and places its pairs after the earlier programs' pairs
    of each expert."""
    pdl_prologue(PDL)
    p = tl.program_id(0)
    programs = tl.num_programs(0)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    earlier = tl.zeros([E_PAD], dtype=tl.int32)
    for p0 in range(0, programs, BT):
        ps = p0 + tl.arange(0, BT)
        tile = tl.load(partial_ptr + ps[:, None] * E_PAD + experts[None, :], mask=ps[:, None] < programs, other=0)  # fmt: skip
        counts += tl.sum(tile, axis=0)
        earlier += tl.sum(tl.where(ps[:, None] < p, tile, 0), axis=0)
    starts, _ = _layout(counts, sorted_ptr, ends_ptr, block_expert_ptr, num_pairs, num_blocks,
                        E, p, programs, E_PAD, BLOCK_M, BM_PAD, BT, False)  # fmt: skip
    lo = p * per_program
    hi = tl.minimum(lo + per_program, num_pairs)
    _place_pairs(ids_ptr, sorted_ptr, pair_rows_ptr, lo, hi, E, starts + earlier, E_PAD, SUB)
