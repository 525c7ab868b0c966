"""What the planner chooses between: a `Layout` (how many nodes of which kind, TP per pool) and
its per-pool `Knobs`. Pure Python."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """`num_prefill` prefill and `num_decode` decode nodes (PD), or `num_decode` colocated
    nodes (`colocated`, no prefill pool). A node of a pool spans that pool's TP size of
    devices."""

    num_prefill: int
    num_decode: int
    colocated: bool = False
    prefill_tp: int = 1
    decode_tp: int = 1

    def __post_init__(self) -> None:
        if self.num_decode < 1 or self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError(f"bad layout: {self}")
        if self.colocated != (self.num_prefill == 0):
            raise ValueError(f"a layout is colocated exactly when it has no prefill node: {self}")

    @property
    def devices(self) -> int:
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    @property
    def name(self) -> str:
        """`2p2d`, `4c`, with the TP size where it is not 1: `1p(tp2)2d`."""
        if self.colocated:
            return f"{self.num_decode}c" + (f"(tp{self.decode_tp})" if self.decode_tp > 1 else "")
        p = f"{self.num_prefill}p" + (f"(tp{self.prefill_tp})" if self.prefill_tp > 1 else "")
        return p + f"{self.num_decode}d" + (f"(tp{self.decode_tp})" if self.decode_tp > 1 else "")

    @classmethod
    def parse(cls, text: str) -> Layout:
        m = re.fullmatch(r"(\d+)p(?:\(tp(\d+)\))?(\d+)d(?:\(tp(\d+)\))?", text.lower())
        if m and int(m[1]) >= 1 and int(m[3]) >= 1:
            return cls(int(m[1]), int(m[3]), False, int(m[2] or 1), int(m[4] or 1))
        m = re.fullmatch(r"(\d+)c(?:\(tp(\d+)\))?", text.lower())
        if m and int(m[1]) >= 1:
            return cls(0, int(m[1]), True, 1, int(m[2] or 1))
        raise ValueError(f"layout {text!r} is neither XpYd nor Nc (X, Y, N >= 1)")


@dataclass(frozen=True)
class Knobs:
    """Per-pool settings searched with the layout. A colocated layout has no prefill pool:
    its nodes use the decode knobs (their `decode_max_num_batched_tokens` is the chunk size
    that mixes prefill into decode steps). `kv_memory_fraction` is None on CPU (a fixed KV
    byte budget)."""

    decode_max_num_seqs: int
    decode_max_num_batched_tokens: int
    prefill_max_num_batched_tokens: int | None = None
    kv_memory_fraction: float | None = None

    def __post_init__(self) -> None:
        for name in ("decode_max_num_seqs", "decode_max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if (
            self.prefill_max_num_batched_tokens is not None
            and self.prefill_max_num_batched_tokens < 1
        ):
            raise ValueError(
                f"prefill_max_num_batched_tokens must be >= 1, got {self.prefill_max_num_batched_tokens}"
            )
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")

    def describe(self, layout: Layout) -> str:
        parts = []
        if not layout.colocated:
            parts.append(f"P tok {self.prefill_max_num_batched_tokens}")
        else:
            parts.append(f"chunk {self.decode_max_num_batched_tokens}")
        parts.append(f"D seqs {self.decode_max_num_seqs}")
        if self.kv_memory_fraction is not None:
            parts.append(f"kv {self.kv_memory_fraction:g}")
        return ", ".join(parts)


def candidate_layouts(devices: int, tp_sizes: tuple[int, ...] = (1,)) -> list[Layout]:
    """Every PD layout (x prefill, y decode nodes, at most `devices` devices in all, TP from
    `tp_sizes` per pool) and colocated data parallel over all devices per TP size."""
    out = []
    for ptp in tp_sizes:
        for dtp in tp_sizes:
            for x in range(1, devices // ptp + 1):
                for y in range(1, (devices - x * ptp) // dtp + 1):
                    out.append(Layout(x, y, False, ptp, dtp))
    for tp in tp_sizes:
        if devices // tp >= 1:
            out.append(Layout(0, devices // tp, True, 1, tp))
    return out
