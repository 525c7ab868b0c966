"""Copy KV blocks from one pool into another, possibly on another GPU.

Pools are `[num_layers, planes, num_blocks, block_size, heads, head_dim]` (planes 2: K and V;
1: MLA's latent), contiguous, of one dtype; their block counts may differ. One program copies one
plane of one block of one layer, so a set of layers moves in one launch and one pass over the
bytes, with no gather buffer and no host work per block. FP8 pools are copied as their bytes.
`BlockCopier` copies whole blocks between pools of one per-block shape; `HeadCopier` copies a
range of KV heads into a range of another pool's heads (tensor-parallel pools hold different
heads of the model).

The destination may live on another GPU: the kernel runs on the source's GPU and stores through
a peer mapping, over NVLink or PCIe. A CUDA IPC-opened pool is mapped for the source's GPU when
it is opened in that GPU's context (kv_transfer.ipc_handles.open_pool); a pool this process
allocated on another GPU needs `enable_peer_access` for the pair first.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import triton
import triton.language as tl

MAX_CHUNK = 4096  # elements a program moves per load/store pair (8 KiB of bf16)


@triton.jit(do_not_specialize=["src_blocks", "dst_blocks", "first_plane"])
def _copy_blocks_kernel(
    src_ptr, dst_ptr, pairs_ptr, src_blocks, dst_blocks, first_plane,
    BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Program (p, q): block pair p, plane q of the layer range (plane = layer * planes + its
    plane in the layer)."""
    pair = tl.program_id(0)
    plane = (first_plane + tl.program_id(1)).to(tl.int64)
    src_block = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
    dst_block = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
    src = src_ptr + (plane * src_blocks + src_block) * BLOCK_NUMEL
    dst = dst_ptr + (plane * dst_blocks + dst_block) * BLOCK_NUMEL
    for start in range(0, BLOCK_NUMEL, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < BLOCK_NUMEL
        values = tl.load(src + offs, mask=mask, eviction_policy="evict_first")
        tl.store(dst + offs, values, mask=mask)


@triton.jit(do_not_specialize=["src_blocks", "dst_blocks", "first_plane"])
def _copy_heads_kernel(
    src_ptr, dst_ptr, pairs_ptr, src_blocks, dst_blocks, first_plane,
    ROWS: tl.constexpr, SRC_ROW: tl.constexpr, DST_ROW: tl.constexpr, SRC_OFF: tl.constexpr,
    DST_OFF: tl.constexpr, RUN: tl.constexpr, ROW_TILE: tl.constexpr, COL_TILE: tl.constexpr,
):  # fmt: skip
    """As `_copy_blocks_kernel`, but a block is ROWS token rows (SRC_ROW / DST_ROW elements
    apart), of which RUN elements move, from SRC_OFF in each source row to DST_OFF in each
    destination row."""
    pair = tl.program_id(0)
    plane = (first_plane + tl.program_id(1)).to(tl.int64)
    src_block = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
    dst_block = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
    src = src_ptr + (plane * src_blocks + src_block) * (ROWS * SRC_ROW) + SRC_OFF
    dst = dst_ptr + (plane * dst_blocks + dst_block) * (ROWS * DST_ROW) + DST_OFF
    for row0 in range(0, ROWS, ROW_TILE):
        rows = row0 + tl.arange(0, ROW_TILE)[:, None]
        for col0 in range(0, RUN, COL_TILE):
            cols = col0 + tl.arange(0, COL_TILE)[None, :]
            mask = (rows < ROWS) & (cols < RUN)
            values = tl.load(src + rows * SRC_ROW + cols, mask=mask, eviction_policy="evict_first")
            tl.store(dst + rows * DST_ROW + cols, values, mask=mask)


def block_pairs(src_ids: list[int], dst_ids: list[int]) -> torch.Tensor:
    """`[n, 2]` int32 (source block, destination block) rows, on the host."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    return torch.tensor(list(zip(src_ids, dst_ids, strict=True)), dtype=torch.int32).view(-1, 2)


class BlockCopier:
    """Copies blocks from `src` into `dst`; the pools are checked once, here, so that a call
    costs little more than the launch (one per layer during a prefill)."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if src.dtype != dst.dtype or src.shape[:2] + src.shape[3:] != dst.shape[:2] + dst.shape[3:]:
            raise ValueError(
                f"pool layouts differ: {src.dtype} {list(src.shape)} vs {dst.dtype} {list(dst.shape)}"
            )
        if not (src.is_contiguous() and dst.is_contiguous()):
            raise ValueError("both pools must be contiguous")
        if src.element_size() == 1:
            # FP8 pools move as bytes: bit-exact, and Triton's fp8 types need sm_89+.
            src, dst = src.view(torch.uint8), dst.view(torch.uint8)
        self.src, self.dst = src, dst
        self.num_layers, self.planes = src.shape[0], src.shape[1]
        self.block_numel = math.prod(src.shape[3:])
        self.chunk = min(triton.next_power_of_2(self.block_numel), MAX_CHUNK)
        self.num_warps = 4 if self.chunk <= 2048 else 8
        self.device = torch.cuda.device(src.device) if src.is_cuda else nullcontext()

    def __call__(self, pairs: torch.Tensor, layers: range) -> None:
        """`dst[l, :, d] = src[l, :, s]` for every `(s, d)` row of `pairs` and every `l` in
        `layers` (a step-1 range), queued on the current stream of src's device. `pairs` (from
        `block_pairs`, contiguous) lives on src's device; ids are not bound-checked here."""
        if pairs.dtype != torch.int32 or pairs.dim() != 2 or pairs.shape[1] != 2:
            raise ValueError(f"pairs must be [n, 2] int32, not {pairs.dtype} {list(pairs.shape)}")
        if layers.step != 1 or layers.start < 0 or layers.stop > self.num_layers:
            raise ValueError(
                f"{layers} is not a step-1 range of the pool's {self.num_layers} layers"
            )
        if not len(layers) or not pairs.shape[0]:
            return
        with self.device:
            _copy_blocks_kernel[(pairs.shape[0], self.planes * len(layers))](
                self.src, self.dst, pairs, self.src.shape[2], self.dst.shape[2],
                self.planes * layers.start,
                BLOCK_NUMEL=self.block_numel, CHUNK=self.chunk, num_warps=self.num_warps,
            )  # fmt: skip


class HeadCopier:
    """Copies KV heads `src_heads` of `src`'s blocks into heads `dst_heads` of `dst`'s blocks
    (indices into each pool's own heads, ranges of one length); the other heads of `dst` stay as
    they are. Pools differ only in block and head counts; checked once, here."""

    def __init__(
        self, src: torch.Tensor, dst: torch.Tensor, src_heads: range, dst_heads: range
    ) -> None:
        if (
            src.dtype != dst.dtype
            or src.dim() != 6
            or dst.dim() != 6
            or (
                [src.shape[0], src.shape[1], src.shape[3], src.shape[5]]
                != [dst.shape[0], dst.shape[1], dst.shape[3], dst.shape[5]]
            )
        ):
            raise ValueError(
                f"pool layouts differ: {src.dtype} {list(src.shape)} vs {dst.dtype} {list(dst.shape)}"
            )
        if not (src.is_contiguous() and dst.is_contiguous()):
            raise ValueError("both pools must be contiguous")
        for heads, pool in ((src_heads, src), (dst_heads, dst)):
            if heads.step != 1 or not len(heads) or heads.start < 0 or heads.stop > pool.shape[4]:
                raise ValueError(f"heads {heads} are not a step-1 range of {pool.shape[4]} heads")
        if len(src_heads) != len(dst_heads):
            raise ValueError(f"heads {src_heads} and {dst_heads} differ in length")
        if src.element_size() == 1:
            src, dst = src.view(torch.uint8), dst.view(torch.uint8)
        self.src, self.dst = src, dst
        self.num_layers = src.shape[0]
        head_dim = src.shape[5]
        self.rows = src.shape[3]
        self.src_row, self.dst_row = src.shape[4] * head_dim, dst.shape[4] * head_dim
        self.src_off, self.dst_off = src_heads.start * head_dim, dst_heads.start * head_dim
        self.run = len(src_heads) * head_dim
        self.col_tile = min(triton.next_power_of_2(self.run), MAX_CHUNK)
        self.row_tile = min(triton.next_power_of_2(self.rows), max(1, MAX_CHUNK // self.col_tile))
        self.num_warps = 4 if self.row_tile * self.col_tile <= 2048 else 8
        self.device = torch.cuda.device(src.device) if src.is_cuda else nullcontext()

    def __call__(self, pairs: torch.Tensor, layers: range) -> None:
        """As `BlockCopier.__call__`, for the heads this copier moves."""
        if pairs.dtype != torch.int32 or pairs.dim() != 2 or pairs.shape[1] != 2:
            raise ValueError(f"pairs must be [n, 2] int32, not {pairs.dtype} {list(pairs.shape)}")
        if layers.step != 1 or layers.start < 0 or layers.stop > self.num_layers:
            raise ValueError(
                f"{layers} is not a step-1 range of the pool's {self.num_layers} layers"
            )
        if not len(layers) or not pairs.shape[0]:
            return
        with self.device:
            planes = self.src.shape[1]
            _copy_heads_kernel[(pairs.shape[0], planes * len(layers))](
                self.src, self.dst, pairs, self.src.shape[2], self.dst.shape[2],
                planes * layers.start,
                ROWS=self.rows, SRC_ROW=self.src_row, DST_ROW=self.dst_row, SRC_OFF=self.src_off,
                DST_OFF=self.dst_off, RUN=self.run, ROW_TILE=self.row_tile,
                COL_TILE=self.col_tile, num_warps=self.num_warps,
            )  # fmt: skip


def enable_peer_access(device: torch.device, peer: torch.device) -> None:
    """Let kernels on `device` read and write what this process allocated on `peer` (not
    memory IPC-opened in `peer`'s context: that stays unmapped for `device`). torch enables it,
    from the source's GPU to the destination's, on its first copy between them; one element's
    copy does that and costs nothing afterwards."""
    if device != peer:
        torch.empty(1, device=peer).copy_(torch.empty(1, device=device))
        torch.cuda.synchronize(device)
