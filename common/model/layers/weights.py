"""What every parameter's `weight_loader(param, full_tensor, shard_id)` shares.

Contract: a loader receives the FULL checkpoint tensor (every rank gets the same one) and
copies this rank's slice into `param`; `shard_id` names the part of a fused parameter the
tensor fills (None: the whole parameter). A mismatched shape is a ValueError; the model's
`load_weights` adds the checkpoint name to it.
"""

from __future__ import annotations

import torch


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def default_weight_loader(
    param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None
) -> None:
    """Replicated parameters (norms): the full tensor as it is."""
    if shard_id is not None:
        raise ValueError(f"is not fused, got shard {shard_id}")
    copy_checked(param.data, loaded)
