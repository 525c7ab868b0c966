"""Attention backends by name. The model imports none of them; the runner picks one here."""

from __future__ import annotations

from collections.abc import Callable

from common.model.attention.base import AttentionBackend, AttentionMetadata, ForwardContext


def _torch() -> AttentionBackend:
    from common.model.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def _triton() -> AttentionBackend:
    from common.model.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


def _flash_attn() -> AttentionBackend:
    from common.model.attention.flash_attn_backend import FlashAttnBackend

    return FlashAttnBackend()


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch": _torch,
    "triton": _triton,
    "flash_attn": _flash_attn,
}


def create_backend(name: str) -> AttentionBackend:
    """A backend by its registered name (`auto` is resolved by `selection.choose_backend`)."""
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose from auto, {', '.join(BACKENDS)}"
        )
    return BACKENDS[name]()


__all__ = ["AttentionBackend", "AttentionMetadata", "ForwardContext", "create_backend", "BACKENDS"]
