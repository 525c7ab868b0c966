"""Every environment variable the project reads, typed, with one prefix: PDSERVE_."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted GGUF checkpoints and the tokenizer classes AutoTokenizer picked are kept
    (PDSERVE_CACHE_DIR, default ~/.cache/pdserve)."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


def prebuilt_cache_dir() -> Path | None:
    """A read-only cache filled ahead of time, read before `cache_dir()` and never written
    (PDSERVE_PREBUILT_CACHE_DIR; unset: none). The CPU image converts the embedded model into
    one at build time, outside ~/.cache, which Kubernetes pods mount as an empty volume."""
    value = os.environ.get("PDSERVE_PREBUILT_CACHE_DIR")
    return Path(value) if value else None


def log_level() -> str:
    return os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper()


def profile_dir() -> Path | None:
    """Where node processes write a cProfile of their main loop (PDSERVE_PROFILE_DIR; unset: no
    profiling)."""
    value = os.environ.get("PDSERVE_PROFILE_DIR")
    return Path(value) if value else None


def pdl() -> bool:
    """Programmatic dependent launch of the Triton kernels in CUDA graphs, Hopper and later
    (PDSERVE_PDL, default on; "0" turns it off: A/B runs, and per-kernel profiles, whose times
    would count each kernel's wait for the one before). See `common/model/kernels/pdl.py`."""
    return os.environ.get("PDSERVE_PDL", "1") != "0"


def fresh_prefill() -> bool:
    """Prefill steps of long fresh prompts through PyTorch's fused SDPA kernel
    (PDSERVE_FRESH_PREFILL, default on; "0" keeps every prefill on the paged Triton kernel: A/B
    runs). See `common/model/attention/fresh_prefill.py`."""
    return os.environ.get("PDSERVE_FRESH_PREFILL", "1") != "0"


def api_key() -> str | None:
    """The router's API key when --api-key is not given (PDSERVE_API_KEY; unset or empty: none)."""
    return os.environ.get("PDSERVE_API_KEY") or None


def cluster_secret() -> bytes | None:
    """Shared secret that signs every control message and KV frame header between the router
    and the nodes (PDSERVE_CLUSTER_SECRET). Required when any of their sockets binds to an
    address other than loopback; unset or empty: frames are not signed."""
    value = os.environ.get("PDSERVE_CLUSTER_SECRET")
    return value.encode() if value else None


def setup_logging(name: str) -> None:
    """Log lines of a node process (or one of its ranks), tagged with `name` and its pid."""
    import logging

    logging.basicConfig(
        level=log_level(),
        format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
