"""Tile loads the Triton GEMM kernels share."""

import triton
import triton.language as tl


@triton.jit
def load_k(rows, ks, K, EVEN_K: tl.constexpr):
    """rows[:, ks] (`rows` a column of row pointers, `ks` the K offsets): zeros past K unless
    EVEN_K says no tile runs past it."""
    if EVEN_K:
        tile = tl.load(rows + ks[None, :])
    else:
        tile = tl.load(rows + ks[None, :], mask=ks[None, :] < K, other=0.0)
    return tile
