"""Which attention backend `auto` means on this device, and why (logged by the worker)."""

from __future__ import annotations

import importlib.util

import torch

from common.model.attention.flash_attn_backend import (
    REQUIRED_BLOCK_SIZE_MULTIPLE,
    check_block_size,
    check_kv_dtype,
    check_latent,
    flash_attn_available,
)


def choose_backend(
    name: str,
    device: torch.device,
    block_size: int,
    kv_dtype: torch.dtype | None = None,
    latent: bool = False,
) -> tuple[str, str]:
    """Return (backend name, reason). Explicit names are returned as given. `kv_dtype` is the
    KV cache's dtype when known: an FP8 cache rules flash_attn out, as does `latent` (the
    model's attention is DeepSeek's MLA)."""
    kv_fp8 = kv_dtype == torch.float8_e4m3fn
    if name == "flash_attn":
        check_kv_dtype(kv_dtype)
        check_latent(latent)
        if not flash_attn_available():
            raise ValueError(
                "--attention-backend flash_attn needs the flash_attn package and a CUDA GPU"
            )
        check_block_size(block_size)
    if name != "auto":
        return name, "requested"
    if device.type != "cuda":
        return "torch", "CPU device: the torch reference backend"
    if kv_fp8 or latent:
        what = "FP8 KV cache" if kv_fp8 else "latent attention (MLA)"
        if importlib.util.find_spec("triton") is not None:
            return "triton", f"{what}: triton kernels (flash_attn has no path for it)"
        return "torch", f"{what} and triton not importable: the torch reference backend"
    if flash_attn_available() and block_size % REQUIRED_BLOCK_SIZE_MULTIPLE == 0:
        return "flash_attn", "flash_attn is installed and the page size suits it"
    if importlib.util.find_spec("triton") is not None:
        why = (
            "flash_attn not installed"
            if not flash_attn_available()
            else (
                f"block size {block_size} is not a multiple of {REQUIRED_BLOCK_SIZE_MULTIPLE} for flash_attn"
            )
        )
        return "triton", f"{why}; triton kernels"
    return "torch", "neither flash_attn nor triton importable"
