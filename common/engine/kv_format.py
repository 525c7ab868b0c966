"""What two KV pools must agree on before one ships KV into the other (pure Python, no torch).

A prefill node's KV is only usable by a decode node that stores and reads it the same way: the
same element type and, for FP8, the same per-layer scales (a value stored as `x / scale` reads
back as `stored * scale`), the same model quantization (which computed the K and V), the same
architecture and cache geometry (`KVCacheGeometry`: K and V planes of `num_kv_heads` heads, or
MLA's one latent plane of one head of kv_lora_rank + rope values), the same block size, and
the same speculative decoding method and draft model (what decode needs to start speculating
moves with the KV; K may differ). Every node publishes its `KVFormat` in its heartbeat
(`info["kv_format"]`); the router pairs only nodes whose formats are equal, and a KV receiver
refuses a sender whose announced format differs (kv_transfer).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.model.quantization.config import QuantConfig
from common.model.source import ModelSource
from common.model.spec import KVCacheGeometry

FEW_SCALES = 4  # per-layer scales are listed up to this many layers, digested beyond
GEOMETRY_FIELDS = ("planes", "num_kv_heads", "head_dim")  # compared and named as one


@dataclass(frozen=True)
class KVFormat:
    kv_dtype: str  # the pool's torch dtype name: "bfloat16", "float8_e4m3fn", ...
    kv_scales: str  # "none" (not FP8), else `scales_summary` of the per-layer K and V scales
    quantization: str  # the model's linear quantization: "none" or `quantization_name`
    architecture: str  # the checkpoint's `architectures` entry, e.g. "LlamaForCausalLM"
    num_layers: int
    # The model's `KVCacheGeometry` (all heads, not one tensor-parallel rank's): planes 2 is
    # K and V of num_kv_heads heads; planes 1 is MLA's latent, one head of head_dim values.
    planes: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    # `speculative_name`: "none", "ngram", "draft:<model>", "eagle3:<model>" (K excluded)
    speculative: str = "none"

    @classmethod
    def from_dict(cls, raw: Any) -> KVFormat:
        """A format as a heartbeat or a transfer announced it; ValueError naming what is wrong."""
        if not isinstance(raw, dict):
            raise ValueError(f"a KV format is a map, got {type(raw).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        if set(raw) != set(names):
            missing, unknown = (
                sorted(set(names) - set(raw)),
                sorted(map(str, set(raw) - set(names))),
            )
            raise ValueError(f"KV format fields: missing {missing}, unknown {unknown}")
        for f in dataclasses.fields(cls):
            value = raw[f.name]
            wanted = str if f.type in ("str", str) else int
            if type(value) is not wanted:
                raise ValueError(f"KV format {f.name} must be {wanted.__name__}, got {value!r}")
        return cls(**raw)

    def __post_init__(self) -> None:
        if self.planes not in (1, 2):
            raise ValueError(
                f"KV format planes must be 1 (latent) or 2 (K and V), got {self.planes}"
            )
        sizes = {
            n: getattr(self, n) for n in ("num_layers", "num_kv_heads", "head_dim", "block_size")
        }
        bad = {n: v for n, v in sizes.items() if v < 1}
        if bad:
            raise ValueError(f"KV format sizes must be >= 1, got {bad}")

    @property
    def geometry(self) -> KVCacheGeometry:
        return KVCacheGeometry(self.planes, self.num_kv_heads, self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """`float8_e4m3fn KV (scales all 1.0), weights none, LlamaForCausalLM K/V 8 heads x 128
        (32 layers), 16-token blocks, speculative ngram`, or with MLA's cache
        `... DeepseekV2ForCausalLM latent 1 x 576 (27 layers) ...`."""
        scales = "" if self.kv_scales == "none" else f" (scales {self.kv_scales})"
        spec = "" if self.speculative == "none" else f", speculative {self.speculative}"
        return (
            f"{self.kv_dtype} KV{scales}, weights {self.quantization}, {self.architecture} "
            f"{self.geometry.describe()} ({self.num_layers} layers), {self.block_size}-token "
            f"blocks{spec}"
        )

    def mismatch(self, other: KVFormat, labels: tuple[str, str] = ("this", "other")) -> str | None:
        """None when the formats agree, else every differing field with both values, each
        followed by whose it is: `kv_dtype float8_e4m3fn (prefill A) vs bfloat16 (decode B)`;
        the geometry reads as one: `cache geometry latent 1 x 576 (A) vs K/V 8 heads x 128 (B)`."""
        mine, theirs = labels
        diffs = []
        for f in dataclasses.fields(self):
            name, a, b = f.name, getattr(self, f.name), getattr(other, f.name)
            if name in GEOMETRY_FIELDS[1:]:
                continue  # in the geometry, named at "planes"
            if name == GEOMETRY_FIELDS[0]:
                name, a, b = "cache geometry", self.geometry.describe(), other.geometry.describe()
            if a != b:
                diffs.append(f"{name} {a} ({mine}) vs {b} ({theirs})")
        return "; ".join(diffs) or None


def scales_summary(k_scales: Sequence[float], v_scales: Sequence[float]) -> str:
    """Equal for equal scales, short either way: `all 1.0` when every K and V scale is one
    value, the values themselves for a few layers, else a digest with their ranges."""
    if len(k_scales) != len(v_scales):
        raise ValueError(f"{len(k_scales)} K scales but {len(v_scales)} V scales")
    k, v = [repr(float(s)) for s in k_scales], [repr(float(s)) for s in v_scales]
    if len(set(k + v)) == 1:
        return f"all {k[0]}"
    if len(k) <= FEW_SCALES:
        return f"k {','.join(k)} v {','.join(v)}"
    digest = hashlib.sha256(" ".join(k + ["|"] + v).encode()).hexdigest()[:12]
    return (
        f"sha256:{digest} (k {min(map(float, k))}..{max(map(float, k))}, "
        f"v {min(map(float, v))}..{max(map(float, v))})"
    )


def quantization_name(scheme: QuantConfig | None) -> str:
    """`none`, or the scheme of the linear layers that compute K and V: `fp8 block 128x128
    weights, group activations`."""
    if scheme is None:
        return "none"
    block = f" {scheme.block[0]}x{scheme.block[1]}" if scheme.block else ""
    return f"fp8 {scheme.weights}{block} weights, {scheme.activations} activations"


def speculative_name(method: str, draft: ModelSource | None = None) -> str:
    """What two pools' speculation must agree on: the method, and for `draft` / `eagle3` the
    draft model as `<method>:<name> config:<digest>`, the digest of its config.json (parsed, so
    two copies of one checkpoint agree whatever their whitespace). K and the n-gram sizes are
    left out: they change how many tokens are drafted, not what the KV must carry."""
    if method in ("none", "ngram"):
        return method
    if draft is None:
        raise ValueError(f"speculative method {method!r} needs its draft model")
    config = draft.directory / "config.json"
    if not config.exists():
        return f"{method}:{draft.name}"
    canonical = json.dumps(json.loads(config.read_text()), sort_keys=True)
    return f"{method}:{draft.name} config:{hashlib.sha256(canonical.encode()).hexdigest()[:12]}"
