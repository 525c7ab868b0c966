"""Attention backends by name. The model imports none of them; the runner picks one here."""

from __future__ import annotations

from collections.abc import Callable

from common.model.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    ForwardContext,
    check_mla_prefill,
)


def _torch(mla_prefill: str) -> AttentionBackend:
    from common.model.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(mla_prefill)


def _triton(mla_prefill: str) -> AttentionBackend:
    from common.model.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(mla_prefill)


def _flash_attn(mla_prefill: str) -> AttentionBackend:
    from common.model.attention.flash_attn_backend import FlashAttnBackend

    return FlashAttnBackend()  # no MLA path: `mla_prefill` has nothing to choose


BACKENDS: dict[str, Callable[[str], AttentionBackend]] = {
    "torch": _torch,
    "triton": _triton,
    "flash_attn": _flash_attn,
}


def create_backend(name: str, mla_prefill: str = "auto") -> AttentionBackend:
    """A backend by its registered name (`auto` is resolved by `selection.choose_backend`);
    `mla_prefill` is the form of its MLA prefill steps (`base.MLA_PREFILL_MODES`)."""
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose from auto, {', '.join(BACKENDS)}"
        )
    return BACKENDS[name](check_mla_prefill(mla_prefill))


__all__ = ["AttentionBackend", "AttentionMetadata", "ForwardContext", "create_backend", "BACKENDS"]
