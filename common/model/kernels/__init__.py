"""Triton kernels for CUDA (Hopper-tuned); each also runs on CPU under `TRITON_INTERPRET=1`.

- `paged_attention`: varlen causal prefill and split-K decode over the paged KV pool.
- `mla_attention`: the same prefill for DeepSeek's latent (MLA) cache in absorbed form, the
  shared MLA tile loop, latent write; `mla_decode`: MLA split-K decode on that loop.
- `fused_ops`: RMSNorm (+ residual add), SiLU-and-mul, neox rotary, paged KV write.
- `fp8_quant`: RMSNorm and SiLU-and-mul emitting FP8 activations, and a plain FP8 quantization.
- `block_copy`: KV blocks (whole, or a range of KV heads) from one pool into another, across
  GPUs too (cuda_ipc).
- `sampling`: the sampler's exponential race and exact top-p threshold, one program per row.
- `pdl`: programmatic dependent launch for the kernels that CUDA graphs record.

`triton.jit` decides at decoration time whether a kernel is compiled or interpreted, so these
modules are imported only by the code that launches them (`common.model.ops`, the triton attention
backend, the tests), never eagerly, and `TRITON_INTERPRET` must be set before that import.
"""

from __future__ import annotations

import sys

import triton
import triton.language as tl


def _fix_interpreter() -> None:
    """Two gaps of Triton 3.6's CPU interpreter that these kernels hit; compiled runs are
    untouched. (1) A runtime loop bound becomes an int through `int(array)` on a shape-(1,)
    array, which NumPy >= 2.4 rejects. (2) `tl.dot` multiplies bf16 operands as their raw uint16
    bits; they are widened to fp32 first (what the tensor cores' fp32 accumulate amounts to)."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_pdserve_fixed", False):
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patched_tensor(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    create_dot = builder.create_dot

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a, b = self.cast_impl(a, tl.float32), self.cast_impl(b, tl.float32)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    interpreter._patch_lang_tensor = patched_tensor
    builder.create_dot = patched_dot
    builder._pdserve_fixed = True


def _interpret_triton_stdlib() -> None:
    """Triton's own @jit helpers (tl.zeros, tl.cdiv, tl.max, tl.sum, ...) were decorated when
    `triton.language` was imported; if that happened before TRITON_INTERPRET was set (torch or
    transformers import triton early, e.g. in another test module of the same session), they
    are compiled-only and an interpreted kernel fails on calling them. Re-wrap them as
    interpreted functions, in every `triton.language` module that holds them."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped: dict[int, InterpretedFunction] = {}
    modules = [
        m for name, m in sys.modules.items() if name.split(".")[:2] == ["triton", "language"]
    ]
    for module in modules:
        for name, obj in list(vars(module).items()):
            if isinstance(obj, JITFunction):
                if id(obj) not in wrapped:
                    wrapped[id(obj)] = InterpretedFunction(obj.fn)
                setattr(module, name, wrapped[id(obj)])


if triton.knobs.runtime.interpret:
    _fix_interpreter()
    _interpret_triton_stdlib()
