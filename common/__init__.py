"""Shared engine core: model code, paged KV cache, block allocator, scheduler, sampler.

`from common import LLM, SamplingParams` is the offline Python API. The names are resolved
lazily so that the pure-Python parts (block allocator, scheduler) import without torch.
"""

from typing import TYPE_CHECKING

__all__ = ["LLM", "SamplingParams", "RequestOutput"]

if TYPE_CHECKING:
    from common.engine.llm import LLM, RequestOutput
    from common.protocol.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput"):
        from common.engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from common.protocol.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'common' has no attribute {name!r}")
