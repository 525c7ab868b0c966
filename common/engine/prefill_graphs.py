"""CUDA graphs for prefill and mixed steps: by token-count bucket, piecewise around attention.

A step of T tokens (prompt chunks, decode rows, any mix) runs padded to the smallest bucket
B >= T. Attention is the one op whose launch depends on the batch's make-up (number of
sequences, longest query), so it runs eagerly and everything between two attentions is one
captured graph (vLLM's piecewise mode): num_layers + 1 replays and num_layers eager attention
calls per step instead of ~10 launches per layer.

Pieces exchange data through static buffers: a layer's qkv projection writes straight into
`qkv` (`projection_buffer`; q, k and v are views of its columns, rotated there in place), else
a piece ends by copying q, k, v into `q`, `k`, `v` (MLA: q_nope, q_pe, latent, k_pe into
theirs, and the layer's `LatentProjection` is kept). The eager part sees only the real
tokens' rows (every backend gets an eager step's shapes, padding rows write no KV): the
attention, then the layer's output projection into `projected` (MLA: the attention alone,
copied into `attn_out`), so the attention's output needs no copy into a static buffer (7 us a
layer for Qwen3-30B-A3B's 2048-token bucket on an H200). The buffer's padding rows hold stale,
finite values (dense ops are row-wise). The per-layer hook runs right after that layer's
attention, as in an eager step. On CPU nothing is captured; the same padded forward and
boundary copies run.
A pipeline stage captures only its layers, reading and writing the carry as `DecodeGraphs` does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from common.engine.cuda_graphs import STAGING_DEPTH, Replay, StagingRing, carry_buffers
from common.engine.kv_cache import KVCache
from common.model.attention import AttentionBackend, AttentionMetadata, ForwardContext
from common.model.attention.base import LatentProjection, Projector
from common.model.graph_capture import recording_graphs
from common.model.registry import CausalLM

log = logging.getLogger(__name__)

LayerHook = Callable[[int], None]


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, ..., 512, then every 256, up to and including max_tokens (a multiple of 16)."""
    if max_tokens < 16 or max_tokens % 16:
        raise ValueError(f"prefill graph max tokens must be a multiple of 16, got {max_tokens}")
    sizes = [s for s in (16, 32, 64, 128, 256, 512) if s < max_tokens]
    sizes += list(range(768, max_tokens, 256))
    return sorted(set(sizes + [max_tokens]))


class PrefillGraphs:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        kv_cache: KVCache,
        max_tokens: int,
        scale: float,
    ) -> None:
        self.model, self.backend, self.kv_cache, self.scale = model, backend, kv_cache, scale
        self.buckets = token_buckets(max_tokens)
        n = self.max_tokens = self.buckets[-1]
        spec, pool = model.spec, kv_cache.pool
        device, dtype = pool.device, model.dtype
        self.on_cuda = device.type == "cuda"
        self._vectors = torch.zeros(2, n, dtype=torch.int64, device=device)  # ids, positions
        self.input_ids, self.positions = self._vectors
        mla = spec.mla
        self.latent = mla is not None
        if mla is None:
            # q, k and v side by side in each row, as the qkv projection leaves them: a piece
            # copies them in one contiguous copy (three strided ones took 25 us a layer for
            # Qwen3-30B-A3B's 2048-token bucket on an H200).
            heads, kv_heads, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
            self.qkv = torch.zeros(n, (heads + 2 * kv_heads) * d, dtype=dtype, device=device)
            self.q, self.k, self.v = _split_heads(self.qkv, heads, kv_heads, d)
            self.attn_out = torch.zeros(n, heads, d, dtype=dtype, device=device)
            # Each layer's output projection, seen as the model runs, and where it writes.
            self.projects: list[Projector | None] = [None] * spec.num_layers
            self.projected = torch.zeros(n, spec.hidden_size, dtype=dtype, device=device)
        else:
            heads = spec.num_heads
            self.q_nope = torch.zeros(n, heads, mla.qk_nope_head_dim, dtype=dtype, device=device)
            self.q_pe = torch.zeros(n, heads, mla.qk_rope_head_dim, dtype=dtype, device=device)
            self.latent_rows = torch.zeros(n, mla.kv_lora_rank, dtype=dtype, device=device)
            self.k_pe = torch.zeros(n, mla.qk_rope_head_dim, dtype=dtype, device=device)
            self.attn_out = torch.zeros(n, heads, mla.v_head_dim, dtype=dtype, device=device)
            # Each layer's kv_b_proj views, seen as the model runs: the same weights each time.
            self.projections: list[LatentProjection | None] = [None] * spec.num_layers
        self.hidden = torch.zeros(n, spec.hidden_size, dtype=dtype, device=device)
        stage = model.stage
        self.residual = None if stage.is_last else torch.zeros_like(self.hidden)
        self.carry_in = None if stage.is_first else carry_buffers(model, n, device)
        self.staging = StagingRing(STAGING_DEPTH, n, 1, pinned=self.on_cuda)
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.launches = 0  # steps served (tests and benchmarks read it)

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def bucket(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every bucket's pieces (largest first, one memory pool); returns bytes used.
        On a CPU device nothing is captured."""
        if not self.on_cuda:
            return 0
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for bucket in reversed(self.buckets):
            side.wait_stream(torch.cuda.current_stream())
            # The kernels' PDL launches (kernels/pdl.py), warm-up included: it compiles them.
            with torch.cuda.stream(side), recording_graphs():
                self._run(bucket, _Boundary(self, bucket, None))  # warm-up, autotune
                torch.cuda.synchronize()
                boundary = _Boundary(self, bucket, None, pool=pool)
                boundary.begin_piece()
                self._run(bucket, boundary)
                boundary.end_piece()
            torch.cuda.current_stream().wait_stream(side)
            self.pieces[bucket] = boundary.graphs
        torch.cuda.synchronize()
        used = torch.cuda.memory_reserved() - before
        log.info(
            "captured prefill graphs for %d token buckets %s (%d pieces each), %.1f MiB",
            len(self.buckets),
            self.buckets,
            len(self.model.stage.layers) + 1,
            used / 2**20,
        )
        return used

    def _run(self, bucket: int, boundary: _Boundary) -> None:
        carry = None if self.carry_in is None else tuple(t[:bucket] for t in self.carry_in)
        out = self.model(self.input_ids[:bucket], self.positions[:bucket], boundary, carry)
        if self.residual is None:
            self.hidden[:bucket].copy_(out)
        else:
            self.hidden[:bucket].copy_(out[0])
            self.residual[:bucket].copy_(out[1])

    @torch.inference_mode()
    def launch(
        self,
        input_ids: list[int],
        positions: list[int],
        metadata: AttentionMetadata,
        fill_ids: tuple[torch.Tensor, torch.Tensor] | None = None,
        on_layer_done: LayerHook | None = None,
        carry: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Replay:
        """Stage one step's tokens (padded to its bucket) and run it; the Replay's output is
        the hidden states of the real tokens, [T, hidden]. `metadata` describes the real
        tokens, as for an eager step. `fill_ids` as in `DecodeGraphs.launch`; `carry` and
        `Replay.carry` between pipeline stages, as there."""
        n = len(input_ids)
        bucket = self.bucket(n)
        slot, generation = self.staging.acquire()
        if carry is not None:
            for buffer, t in zip(self.carry_in, carry, strict=True):
                buffer[:n].copy_(t)
        try:
            stage = slot.vectors
            rows = stage[:2].numpy()  # a list into numpy: 4x faster than torch.tensor
            rows[0, :n], rows[1, :n], rows[:, n:bucket] = input_ids, positions, 0
            self._vectors[:, :bucket].copy_(stage[:2, :bucket], non_blocking=True)
            if fill_ids is not None:
                self.input_ids.index_copy_(0, *fill_ids)
            if self.on_cuda:
                self._replay(bucket, n, metadata, on_layer_done)
            else:
                step = (n, self._context(metadata, on_layer_done))
                self._run(bucket, _Boundary(self, bucket, step))
        except BaseException:
            if self.on_cuda:
                torch.cuda.synchronize()
            slot.release(generation)
            raise
        self.launches += 1
        if self.residual is not None:
            return Replay(
                self.hidden[:n], slot, generation, carry=(self.hidden[:n], self.residual[:n])
            )
        return Replay(self.hidden[:n], slot, generation)

    def _replay(
        self, bucket: int, n: int, metadata: AttentionMetadata, hook: LayerHook | None
    ) -> None:
        pieces = self.pieces[bucket]
        ctx = self._context(metadata, hook)
        pieces[0].replay()
        for layer, piece in zip(self.model.stage.layers, pieces[1:], strict=True):
            self.attend(layer, n, ctx)
            piece.replay()

    def _context(self, metadata: AttentionMetadata, hook: LayerHook | None) -> ForwardContext:
        """The step's attention over the pool, as an eager step builds it (FP8 scales too)."""
        kv = self.kv_cache
        return ForwardContext(
            self.backend, metadata, kv.k_caches, kv.v_caches, self.scale, hook,
            **kv.context_kwargs(),
        )  # fmt: skip

    def attend(self, layer: int, n: int, ctx: ForwardContext) -> None:
        """The eager part between two pieces: layer `layer`'s attention over the first `n`
        (real) rows of the static q, k, v (MLA: q_nope, q_pe, latent, k_pe), writing their KV,
        then its output projection into `projected` (into `attn_out` when the model asked for
        the attention alone: MLA); the context runs the per-layer hook once the layer's KV is
        written."""
        if self.latent:
            out = ctx.latent_attention(
                layer, self.q_nope[:n], self.q_pe[:n], self.latent_rows[:n], self.k_pe[:n],
                self.projections[layer],
            )  # fmt: skip
        else:
            out = ctx.attention(layer, self.q[:n], self.k[:n], self.v[:n])
            project = self.projects[layer]
            if project is not None:
                project(out, self.projected[:n])
                return
        self.attn_out[:n].copy_(out)


class _Boundary(ForwardContext):
    """Stands in for the attention of each layer while the model runs over a bucket: copies q,
    k, v into the static buffers and returns the static attention output. Capturing (`pool`
    given), that is where one piece's graph ends and the next begins; with `step` (the real
    token count and the step's attention context: CPU) the attention runs right there, as a
    replay runs it between pieces; with neither (warm-up) it does not run at all."""

    def __init__(
        self,
        owner: PrefillGraphs,
        bucket: int,
        step: tuple[int, ForwardContext] | None,
        pool: object | None = None,
    ) -> None:
        self.owner, self.bucket, self.step = owner, bucket, step
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def begin_piece(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def end_piece(self) -> None:
        self.graphs[-1].capture_end()

    def projection_buffer(self, rows: int, width: int) -> torch.Tensor | None:
        o = self.owner
        if o.latent or rows != self.bucket or width != o.qkv.shape[1]:
            return None
        return o.qkv[:rows]

    def attention_projected(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        project: Projector,
    ) -> torch.Tensor:
        """The projection runs eagerly with the attention (`PrefillGraphs.attend`), into
        `projected`, which the next piece reads."""
        self._stage(q, k, v)
        self.owner.projects[layer] = project
        self._cut(layer)
        return self.owner.projected[: self.bucket]

    def attention(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self._stage(q, k, v)
        self.owner.projects[layer] = None
        return self._cut(layer)

    def _stage(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """q, k and v into the static `qkv` (already there when the projection wrote it)."""
        o, b = self.owner, self.bucket
        rows = _joined_rows(q, k, v)
        if rows is not None and rows.shape == o.qkv[:b].shape:
            if rows.data_ptr() != o.qkv.data_ptr():  # not projected into the buffer
                o.qkv[:b].copy_(rows)
        else:
            o.q[:b].copy_(q)
            o.k[:b].copy_(k)
            o.v[:b].copy_(v)

    def latent_attention(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        proj: LatentProjection,
    ) -> torch.Tensor:
        o, b = self.owner, self.bucket
        o.q_nope[:b].copy_(q_nope)
        o.q_pe[:b].copy_(q_pe)
        o.latent_rows[:b].copy_(latent)
        o.k_pe[:b].copy_(k_pe)
        o.projections[layer] = proj
        return self._cut(layer)

    def _cut(self, layer: int) -> torch.Tensor:
        o = self.owner
        if self.pool is not None:
            self.end_piece()
            self.begin_piece()
        elif self.step is not None:
            o.attend(layer, *self.step)
        return o.attn_out[: self.bucket]


def _split_heads(
    qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [n, heads, d], k and v [n, kv_heads, d]: views of `qkv`'s columns, in that order."""
    n, q_end, k_end = qkv.shape[0], heads * head_dim, (heads + kv_heads) * head_dim
    q = qkv[:, :q_end].view(n, heads, head_dim)
    k = qkv[:, q_end:k_end].view(n, kv_heads, head_dim)
    v = qkv[:, k_end:].view(n, kv_heads, head_dim)
    return q, k, v


def _joined_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """The [rows, width] tensor whose columns q, k and v are, in that order (the qkv
    projection's output, split and rotated in place), or None if they are not laid out so."""
    rows, width = q.shape[0], sum(t.shape[1] * t.shape[2] for t in (q, k, v))
    step = q.element_size()
    laid_out = (
        all(t.shape[0] == rows and t.stride() == (width, t.shape[2], 1) for t in (q, k, v))
        and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        and q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        and k.data_ptr() == q.data_ptr() + q.shape[1] * q.shape[2] * step
        and v.data_ptr() == k.data_ptr() + k.shape[1] * k.shape[2] * step
    )
    return q.as_strided((rows, width), (width, 1)) if laid_out else None
