"""What the profiler measured, and the JSON cache that makes later plans instant.

Pure Python. A `Profile` holds the raw points and the fits made from them; `ProfileKey` says
which engine it describes (model, dtype, weight quantization, KV dtype, device, TP size, how
the experts are laid out, code version): a cache entry whose key differs in any field is never
used, so an FP8 profile never plans a bf16 deployment, nor a bf16 KV cache's an FP8 one, nor
an expert-parallel MoE profile a tensor-parallel one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.planner.cost_model import CostModel, DecodeFit, ExpertLoad, PrefillFit

ROOT = Path(__file__).resolve().parents[2]
# Sources whose change can change step times: the engine, its kernels and the node loops.
TIMED_SOURCES = ("common", "prefill_node", "decode_node", "kv_transfer")


@dataclass(frozen=True)
class ProfileKey:
    model: str  # the resolved model directory (or name) and load format
    dtype: str  # what activations compute in
    quantization: str  # the weights' scheme as built: "none", "fp8-channel-token", ...
    kv_dtype: str  # the KV pool's dtype: "bfloat16", "float8_e4m3fn", ...
    device: str  # e.g. "NVIDIA H200", "cpu:2threads"
    tp: int
    code_version: str
    # "dense", or an MoE model's routed experts and their layout: "moe128top8-tp" (each rank
    # a slice of every expert) or "moe128top8-ep" (whole experts per rank)
    experts: str = "dense"
    # Pipeline stages of the profiled node: a pipelined prefill pool is planned only from
    # profiles of its own pp (none are measured yet; pp 1 keys read as before).
    pp: int = 1

    def as_text(self) -> str:
        pp = f"|pp{self.pp}" if self.pp > 1 else ""
        return (
            f"{self.model}|{self.dtype}|weights:{self.quantization}|kv:{self.kv_dtype}|"
            f"{self.device}|tp{self.tp}{pp}|experts:{self.experts}|{self.code_version}"
        )

    def describe(self) -> str:
        """The engine the profile measured, for the planner's output."""
        experts = "" if self.experts == "dense" else f", experts {self.experts}"
        return (
            f"{self.device}, {self.dtype}, weights {self.quantization}, KV {self.kv_dtype}, "
            f"TP {self.tp}{experts}" + (f", PP {self.pp}" if self.pp > 1 else "")
        )


@dataclass(frozen=True)
class PrefillPoint:
    """One prefill step: `tokens` new tokens of one prompt after `context` cached ones."""

    tokens: int
    context: int
    seconds: float


@dataclass(frozen=True)
class DecodePoint:
    """One decode step of `batch` sequences, each with `context` tokens of KV."""

    batch: int
    context: int
    seconds: float


@dataclass(frozen=True)
class MemoryInfo:
    """KV capacity of one device. On a GPU, `kv_bytes` was what the pool got at
    `kv_memory_fraction` of `total_bytes`; the rest of that share (weights, activations,
    graphs) is `fixed_bytes`, assumed the same at other fractions. On CPU the pool is a fixed
    byte budget (`total_bytes` and the fraction are None)."""

    kv_bytes_per_token: int
    block_size: int
    kv_bytes: int
    weight_bytes: int
    total_bytes: int | None = None
    kv_memory_fraction: float | None = None

    @property
    def fixed_bytes(self) -> int | None:
        if self.total_bytes is None or self.kv_memory_fraction is None:
            return None
        return int(self.total_bytes * self.kv_memory_fraction) - self.kv_bytes

    def kv_blocks(self, fraction: float | None = None) -> int:
        """Blocks a pool gets at `fraction` (GPU), or the profiled pool (CPU, or None)."""
        budget = self.kv_bytes
        if fraction is not None and self.fixed_bytes is not None:
            budget = int(self.total_bytes * fraction) - self.fixed_bytes
        block_bytes = self.kv_bytes_per_token * self.block_size
        return max(0, budget // block_bytes - 1)  # one padding block, as the worker sizes it


@dataclass(frozen=True)
class Profile:
    key: ProfileKey
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    memory: MemoryInfo
    cost: CostModel
    created: str = ""  # ISO time, for the reader

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        cost = data["cost"]
        decode = dict(cost["decode"])
        experts = decode.pop("experts", None)
        decode["experts"] = None if experts is None else ExpertLoad(**experts)
        return cls(
            key=ProfileKey(**data["key"]),
            prefill=tuple(PrefillPoint(**p) for p in data["prefill"]),
            decode=tuple(DecodePoint(**p) for p in data["decode"]),
            memory=MemoryInfo(**data["memory"]),
            cost=CostModel(
                prefill=PrefillFit(**_tuples(cost["prefill"])), decode=DecodeFit(**decode)
            ),
            created=data.get("created", ""),
        )


def _tuples(d: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


def code_version(root: Path = ROOT) -> str:
    """A hash of the timed sources: a profile taken before an engine change is not reused."""
    digest = hashlib.blake2b(digest_size=8)
    for top in TIMED_SOURCES:
        for path in sorted((root / top).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


class ProfileCache:
    """One JSON file: {key text: profile}. Writes are atomic (temp file, then rename)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def _read(self) -> dict[str, Any]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"profile cache {self.path} is not JSON ({exc.msg})") from None
        if not isinstance(data, dict):
            raise ValueError(f"profile cache {self.path} holds no object")
        return data

    def get(self, key: ProfileKey) -> Profile | None:
        entry = self._read().get(key.as_text())
        if entry is None:
            return None
        profile = Profile.from_dict(entry)
        return profile if profile.key == key else None

    def put(self, profile: Profile) -> None:
        data = self._read()
        data[profile.key.as_text()] = profile.to_dict()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(self.path)
