"""Hopper's tensor memory accelerator (TMA) for the Triton kernels: whether a tensor's rows can
come through a host-side descriptor, and the descriptor itself.

Through TMA one thread issues a whole tile's copy into shared memory, where per-thread loads
spend an address and a load instruction on every few elements. It is a speed choice only:
every kernel that takes a descriptor keeps its per-thread loads for where TMA cannot run.
"""

from __future__ import annotations

import torch

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton before host-side descriptors (3.3): per-thread loads only
    TensorDescriptor = None


def rows_fit(t: torch.Tensor) -> bool:
    """Whether TMA can read `t` (unit stride along its last dimension): a Triton with host
    descriptors, a Hopper or later GPU (or the interpreter on a CPU), and the rows and the
    base on 16-byte boundaries, as the copy engine requires."""
    if TensorDescriptor is None:
        return False
    if t.device.type == "cuda" and torch.cuda.get_device_capability(t.device)[0] < 9:
        return False
    return (t.stride(-2) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def tiles(t: torch.Tensor, block_shape: list[int]):
    """The descriptor of 2-D `t` read in `block_shape` tiles; rows and columns past its end
    read as zeros. Only where `rows_fit(t)`."""
    return TensorDescriptor.from_tensor(t, block_shape)
