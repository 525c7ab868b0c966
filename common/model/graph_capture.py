"""Whether the kernels launched now are being recorded into CUDA graphs (or are the eager
warm-up right before): the engine's graph captures say so with `recording_graphs()`, and
`common/model/kernels/pdl.py` launches with programmatic dependent launch only then. Kept apart
from the kernel modules, which import Triton, so the engine can mark its captures on CPU too."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()


@contextlib.contextmanager
def recording_graphs() -> Iterator[None]:
    """Launches in this thread, until the block ends, are graph captures or their warm-ups."""
    before = getattr(_state, "recording", False)
    _state.recording = True
    try:
        yield
    finally:
        _state.recording = before


def recording() -> bool:
    return getattr(_state, "recording", False)
