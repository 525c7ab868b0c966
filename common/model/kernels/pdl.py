"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of CUDA-graph steps.

A decode step at batch 1 is a chain of a few hundred kernels of a few microseconds each; between
two of them the GPU drains the first, then launches and ramps up the second. With PDL the next
kernel is launched while the current one finishes, and waits in `gdc_wait` for its results.
Only launches recorded into CUDA graphs use it (`graph_capture.recording_graphs()`, which the
engine's decode and prefill captures set): eager launches gained nothing (see `pdl_enabled`).

The contract every kernel launched this way keeps (`pdl_prologue`, its first statement):
- it calls `gdc_launch_dependents`, so its own successor is launched as soon as all of its
  programs are resident; that successor waits for this whole grid before it reads;
- then `gdc_wait`, before touching any memory: reading an activation, or writing anything,
  earlier would race the previous kernel (a buffer reused from the graph's memory pool
  included), and a program that returned before waiting could end the grid before its
  predecessor, breaking the chain below.

Each waiting kernel waits for its predecessor to finish, so ordering stays transitive along the
stream, and a kernel launched without PDL (torch's, cuBLAS's) keeps the ordinary full
serialization on both sides. On CPU (the interpreter) and before Hopper it is off; PDSERVE_PDL=0
turns it off (A/B runs, and `--kernel-profile`, whose per-kernel times count the waiting).

Measured on one H200 (`benchmarks/bench_pdl.py`, Qwen2.5-7B's FP8 linear chain, 28 layers): x1.08
at batch 1, x1.10 at 8, x1.02 at 32; the FP8 decode node loop 3.50 -> 3.25 ms at batch 1. Not
every kernel gains: the Qwen3-30B-A3B batch-1 step took 3.68 ms with the MoE GEMVs
(`fused_moe_gemv`) on PDL against 3.39 without (3.51 with no PDL at all), so they are launched
plainly. Likely why: each of their programs streams one expert slice, the grid about one per SM,
and launched early the programs land on whichever SMs free first rather than spread evenly.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from common import envs
from common.model import graph_capture

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAVE_GDC = True
except ImportError:  # a Triton without grid dependency control: PDL stays off
    _HAVE_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """PDL for a kernel launched on `device` now: CUDA, sm90+, a Triton with grid dependency
    control, `envs.pdl()`, and inside `graph_capture.recording_graphs()`. Read at each launch,
    so a graph keeps what held when it was captured."""
    # Only into CUDA graphs (and the eager warm-up before each capture, so the kernels it
    # compiles are the ones captured): launched eagerly, as prefill steps past the graph
    # buckets are, PDL gained nothing and cost time (a 2k-token FP8 prefill on an H200: 44-51
    # ms against 33 ms without). Checked first: every eager launch asks.
    if not graph_capture.recording() or device.type != "cuda" or not _HAVE_GDC:
        return False
    if triton.knobs.runtime.interpret or not envs.pdl() or not torch.cuda.is_available():
        return False
    return _device_supports(device.index if device.index is not None else 0)


def pdl_args(device: torch.device) -> dict:
    """Keyword arguments for a launch of a kernel that takes `PDL: tl.constexpr = False` and
    calls `pdl_prologue(PDL)` first: the constexpr and the launch attribute, or nothing."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one (the module docstring)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
