"""Which slice of the model each tensor-parallel rank holds (pure Python, no torch).

A node with `tp` ranks splits every layer Megatron-style: q/k/v and gate/up are column-parallel
(each rank computes its heads and its slice of the MLP's intermediate dimension), o_proj and
down_proj are row-parallel (partial sums, all-reduced), the embedding and the LM head are
vocab-parallel (rows of the vocabulary, padded to a multiple of `tp`). KV heads are split like
the query heads; with fewer KV heads than ranks each KV head is replicated on `tp // kv` ranks,
so every rank still holds the KV head its query heads read. Rank r's KV pool holds exactly the
heads of `kv_heads(r)`, which is what KV transfer between different TP sizes maps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.model.spec import ModelSpec


@dataclass(frozen=True)
class TPLayout:
    size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tp must be >= 1, got {self.size}")
        if self.num_heads % self.size:
            raise ValueError(f"tp={self.size} does not divide num_heads={self.num_heads}")
        kv = self.num_kv_heads
        if kv % self.size and self.size % kv:
            raise ValueError(
                f"tp={self.size} neither divides nor is a multiple of num_kv_heads={kv}"
            )
        if self.intermediate_size % self.size:
            raise ValueError(
                f"tp={self.size} does not divide intermediate_size={self.intermediate_size}"
            )

    @classmethod
    def of(cls, spec: ModelSpec, size: int) -> TPLayout:
        return cls(size, spec.num_heads, spec.num_kv_heads, spec.intermediate_size, spec.vocab_size)

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.size

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def intermediate_per_rank(self) -> int:
        return self.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        """Rows of the embedding and LM head on every rank (the last rank's are padded)."""
        return -(-self.vocab_size // self.size)

    def q_heads(self, rank: int) -> range:
        n = self.heads_per_rank
        return range(rank * n, (rank + 1) * n)

    def kv_heads(self, rank: int) -> range:
        """The KV heads rank `rank` holds (and its KV pool stores, in this order)."""
        if self.num_kv_heads >= self.size:
            n = self.kv_heads_per_rank
            return range(rank * n, (rank + 1) * n)
        head = rank * self.num_kv_heads // self.size  # replicated on size // kv ranks
        return range(head, head + 1)

    def kv_head_owners(self, head: int) -> list[int]:
        """Every rank whose pool holds KV head `head` (several when replicated)."""
        return [r for r in range(self.size) if head in self.kv_heads(r)]

    def intermediate(self, rank: int) -> range:
        n = self.intermediate_per_rank
        return range(rank * n, (rank + 1) * n)

    def vocab(self, rank: int) -> range:
        """The vocabulary rows rank `rank` owns (fewer than `vocab_per_rank` on the last)."""
        n = self.vocab_per_rank
        return range(min(rank * n, self.vocab_size), min((rank + 1) * n, self.vocab_size))


def rank_spec(spec: ModelSpec, layout: TPLayout) -> ModelSpec:
    """The numbers one rank's layers and KV pool are built from: its heads, KV heads and MLP
    slice. The vocabulary stays whole (the sampler and token checks see the full vocabulary;
    the embedding and LM head shard it themselves)."""
    if layout.size == 1:
        return spec
    return dataclasses.replace(
        spec,
        num_heads=layout.heads_per_rank,
        num_kv_heads=layout.kv_heads_per_rank,
        intermediate_size=layout.intermediate_per_rank,
    )


def check_expert_parallel(spec: ModelSpec, size: int) -> None:
    """ValueError unless `spec` has experts that `size` ranks can share out whole
    (`TPGroup.expert_parallel`). With one rank expert parallelism is tensor parallelism:
    accepted, so one flag can serve pools of different TP sizes."""
    if spec.moe is None:
        raise ValueError(
            f"enable_expert_parallel needs a mixture-of-experts model; {spec.architecture} is dense"
        )
    if spec.moe.num_experts % size:
        raise ValueError(
            f"enable_expert_parallel: tp={size} does not divide the {spec.moe.num_experts} "
            f"experts of {spec.architecture}"
        )


@dataclass(frozen=True)
class PPLayout:
    """Which layers each pipeline stage holds: stage s runs layers `layers(s)` and keeps only
    their KV; stage 0 also embeds the tokens, the last stage applies the final norm and the
    LM head (so the logits of a step leave the last stage)."""

    sizes: tuple[int, ...]  # layers per stage

    def __post_init__(self) -> None:
        if not self.sizes or any(n < 1 for n in self.sizes):
            raise ValueError(f"every pipeline stage needs at least one layer, got {self.sizes}")

    @classmethod
    def of(cls, num_layers: int, pp: int, partition: str | None = None) -> PPLayout:
        """Even stages (the earlier ones take the remainder), or `partition`: layers per
        stage, comma-separated, summing to `num_layers`."""
        if pp < 1:
            raise ValueError(f"pp must be >= 1, got {pp}")
        if partition is None:
            if pp > num_layers:
                raise ValueError(f"pp={pp} stages for {num_layers} layers")
            base, extra = divmod(num_layers, pp)
            return cls(tuple(base + (s < extra) for s in range(pp)))
        try:
            sizes = tuple(int(part) for part in partition.split(","))
        except ValueError:
            raise ValueError(
                f"pp_layer_partition must be comma-separated ints, got {partition!r}"
            ) from None
        if len(sizes) != pp or sum(sizes) != num_layers:
            raise ValueError(
                f"pp_layer_partition {partition!r} must give {pp} stages summing to the "
                f"model's {num_layers} layers"
            )
        return cls(sizes)

    @property
    def size(self) -> int:
        return len(self.sizes)

    @property
    def num_layers(self) -> int:
        return sum(self.sizes)

    def layers(self, stage: int) -> range:
        start = sum(self.sizes[:stage])
        return range(start, start + self.sizes[stage])

    def stage_of(self, layer: int) -> int:
        return next(s for s in range(self.size) if layer in self.layers(s))


@dataclass(frozen=True)
class StageLayers:
    """What one pipeline stage's model holds: its decoder layers, the embedding if it is the
    first stage, the final norm and LM head if it is the last."""

    layers: range
    is_first: bool = True
    is_last: bool = True

    @classmethod
    def whole(cls, num_layers: int) -> StageLayers:
        return cls(range(num_layers))

    @classmethod
    def of(cls, layout: PPLayout, stage: int) -> StageLayers:
        return cls(layout.layers(stage), stage == 0, stage == layout.size - 1)

    @property
    def is_whole(self) -> bool:
        return self.is_first and self.is_last
