"""EAGLE-3 across the prefill/decode split: the prompt's target hidden states ship with its KV.

A decode node's head runs over every prompt position on a request's first draft, fed the
target's aux hidden states there ([3 x hidden] per position), which only the prefill node
computed. `PromptAuxRows` (prefill node, the runner's `aux_observer`) keeps them per request
as its prompt chunks run; `to_wire` copies them into pinned host memory as the transfer's
completion payload (`KVSender.complete`: a raw frame behind the header), with start position,
dtype and shape in the completion metadata under `AUX_ROWS_KEY`; `observe_shipped` (decode
node, when the KV landed) checks them against `Transfer.payload` and hands them to
`Eagle3Proposer.observe` before the sequence's first step. The decode node computing them
itself would mean running the target over the whole prompt again.

Size: 3 x hidden x 2 bytes per token in bf16 (Llama-3.1-8B: 24 KiB, beside 128 KiB of KV; an
8k-token prompt: 192 MiB). Off the header, every position ships; `MAX_AUX_BYTES` (1 GiB, the
wire's `MAX_PAYLOAD_BYTES`) only bounds a pathological prompt, whose earliest positions are
dropped. Positions not shipped (beyond it, a prefix-cache hit on the prefill node) enter the
head as zeros: the output stays exact, acceptance is lower (`Eagle3Proposer.num_unobserved_rows`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from common.engine.spec_decode.eagle3 import Eagle3Proposer

AUX_ROWS_KEY = "eagle3_aux_rows"
MAX_AUX_BYTES = 1 << 30  # kv_transfer.frames.MAX_PAYLOAD_BYTES (common does not import it)
WIRE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class _Prompt:
    length: int  # prompt tokens
    first: int  # the first position kept (earlier ones would not fit MAX_AUX_BYTES)
    rows: torch.Tensor | None = None  # [length - first, width], on the target's device
    lo: int | None = None  # observed positions lo..hi-1
    hi: int = 0


class PromptAuxRows:
    """Prefill node: per expected request, the aux rows of its prompt positions, on the device
    until `to_wire` (after the prompt's last chunk) or `release`. Not thread-safe: the node
    loop's thread only."""

    def __init__(self, max_bytes: int = MAX_AUX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._prompts: dict[str, _Prompt] = {}

    def expect(self, request_id: str, num_prompt_tokens: int) -> None:
        self._prompts[request_id] = _Prompt(num_prompt_tokens, 0)

    def release(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)

    def observe(
        self, request_ids: list[str], starts: list[int], counts: list[int], aux: torch.Tensor
    ) -> None:
        """`ModelRunner.aux_observer`: item i's counts[i] rows of `aux`, in item order, are its
        positions starts[i].. (`Eagle3Proposer.observe`'s contract). Copies what it keeps."""
        row = 0
        for rid, start, n in zip(request_ids, starts, counts, strict=True):
            prompt = self._prompts.get(rid)
            if prompt is not None and n:
                self._put(prompt, start, aux[row : row + n])
            row += n

    def _put(self, prompt: _Prompt, start: int, rows: torch.Tensor) -> None:
        if prompt.rows is None:
            per_row = rows.shape[1] * rows.element_size()
            prompt.first = max(0, prompt.length - self.max_bytes // per_row)
            prompt.rows = rows.new_empty(prompt.length - prompt.first, rows.shape[1])
        lo, hi = max(start, prompt.first), min(start + len(rows), prompt.length)
        if lo >= hi:
            return
        prompt.rows[lo - prompt.first : hi - prompt.first] = rows[lo - start : hi - start]
        prompt.lo = lo if prompt.lo is None else min(prompt.lo, lo)
        prompt.hi = max(prompt.hi, hi)

    def to_wire(self, request_id: str) -> tuple[dict[str, Any], torch.Tensor] | None:
        """(completion metadata, payload) of the request's observed rows, and forget them; None
        when nothing was observed. The payload is a host tensor of its own, pinned on CUDA;
        this waits for the device-to-host copy, so the sender may read it at once."""
        prompt = self._prompts.pop(request_id, None)
        if prompt is None or prompt.rows is None or prompt.lo is None:
            return None
        rows = prompt.rows[prompt.lo - prompt.first : prompt.hi - prompt.first]
        if rows.is_cuda:
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            done.synchronize()  # only this copy's stream: not a device-wide sync
        else:
            host = rows.contiguous()  # popped: nothing else writes these rows any more
        meta = {"start": prompt.lo, "dtype": str(rows.dtype).removeprefix("torch."),
                "shape": list(rows.shape)}  # fmt: skip
        return meta, host


def rows_from_wire(
    wire: Any, payload: memoryview | bytes | None, width: int, num_prompt_tokens: int
) -> tuple[int, torch.Tensor]:
    """(start position, host rows over `payload`, no copy) of shipped aux rows; ValueError
    naming what does not fit a head reading `width`-wide rows of a `num_prompt_tokens`-token
    prompt."""
    if not isinstance(wire, dict):
        raise ValueError(f"aux rows must be a map, got {type(wire).__name__}")
    start, dtype, shape = (wire.get(k) for k in ("start", "dtype", "shape"))
    if dtype not in WIRE_DTYPES or payload is None:
        raise ValueError(
            f"aux rows of dtype {dtype!r} (one of {sorted(WIRE_DTYPES)}) need a payload, "
            f"got {type(payload).__name__}"
        )
    data = memoryview(payload).cast("B")
    if (
        not isinstance(start, int)
        or not isinstance(shape, list)
        or len(shape) != 2
        or not all(isinstance(n, int) for n in shape)
        or shape[1] != width
        or not 0 <= start < start + shape[0] <= num_prompt_tokens
    ):
        raise ValueError(
            f"aux rows at {start!r} of shape {shape!r} do not fit a prompt of "
            f"{num_prompt_tokens} tokens and rows of {width}"
        )
    torch_dtype = WIRE_DTYPES[dtype]
    if data.nbytes != shape[0] * shape[1] * torch_dtype.itemsize:
        raise ValueError(f"aux rows of shape {shape} in {dtype} are not {data.nbytes} bytes")
    with warnings.catch_warnings():  # a read-only buffer: nothing writes this view
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8)
    return start, flat.view(torch_dtype).view(shape[0], shape[1])


def observe_shipped(
    proposer: Eagle3Proposer,
    request_id: str,
    wire: Any,
    payload: memoryview | bytes | None,
    num_prompt_tokens: int,
) -> int:
    """Decode node: give the head the prompt rows a prefill node shipped (`wire`: the
    metadata, `payload`: `Transfer.payload`; one host-to-device copy, in the head's dtype).
    Returns how many; ValueError for rows that do not fit."""
    head = proposer.head
    width = 3 * head.spec.target_hidden_size
    start, rows = rows_from_wire(wire, payload, width, num_prompt_tokens)
    rows = rows.to(proposer.pool.device, head.fc.weight.dtype)
    proposer.observe([request_id], [start], [len(rows)], rows)
    return len(rows)
