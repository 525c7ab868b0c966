"""Layers own their weights: each parallel layer cuts its rank's slice out of a full checkpoint
tensor and computes with it. Ranks are `TPGroup(rank, size)` without process groups: loading
needs no collectives, and the tests sum row-parallel partials themselves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model.distributed import TPGroup
from common.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    process_weights_after_loading,
)
from common.model.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from common.model.loader import dummy_full_tensors, fill_dummy_weights
from common.model.parallel import TPLayout
from common.model.quantization import UnquantizedLinearMethod
from common.model.quantization.base import written_to
from common.model.registry import MODELS, model_class
from common.model.spec import SUPPORTED_ARCHITECTURES, ModelSpec, RopeSpec

SPEC = ModelSpec(
    architecture="Qwen2ForCausalLM", vocab_size=387, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
    rope=RopeSpec(theta=10000.0), max_position_embeddings=512, tie_word_embeddings=False,
    qkv_bias=True, qk_norm=False, sliding_window=None, eos_token_ids=(2,),
)  # fmt: skip
HD = SPEC.head_dim


def ranks(size: int) -> list[TPGroup]:
    return [TPGroup(r, size) for r in range(size)]


_generator = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_generator)


def load(layer, param, tensor, shard_id=None) -> None:
    param.weight_loader(param, tensor, shard_id)


@pytest.mark.parametrize("tp", [2, 4])
def test_column_and_row_parallel_slices_reassemble_the_full_weight_and_matmul(tp):
    w_up, w_down, x = randn(128, 64), randn(64, 128), randn(3, 64)
    cols = [ColumnParallelLinear(64, 128, g) for g in ranks(tp)]
    rows = [RowParallelLinear(128, 64, g, reduce=False) for g in ranks(tp)]
    for col, row in zip(cols, rows, strict=True):
        load(col, col.weight, w_up)
        load(row, row.weight, w_down)
    assert torch.equal(torch.cat([c.weight for c in cols]), w_up)
    assert torch.equal(torch.cat([r.weight for r in rows], dim=1), w_down)
    hidden = torch.cat([c(x) for c in cols], dim=-1)  # what the ranks hold together
    partials = [r(h) for r, h in zip(rows, hidden.chunk(tp, dim=-1), strict=True)]
    expected = F.linear(F.linear(x, w_up), w_down)
    torch.testing.assert_close(sum(partials), expected, atol=1e-4, rtol=1e-4)  # sum order


def test_row_parallel_bias_is_added_once_by_rank_zero():
    w, b, x = randn(8, 16), randn(8), randn(2, 16)
    rows = [RowParallelLinear(16, 8, g, bias=True, reduce=False) for g in ranks(2)]
    for row in rows:
        load(row, row.weight, w)
        load(row, row.bias, b)
    partials = [r(part) for r, part in zip(rows, x.chunk(2, dim=-1), strict=True)]
    torch.testing.assert_close(sum(partials), F.linear(x, w, b))


def test_gate_and_up_land_at_their_offsets_and_the_whole_fused_tensor_loads_alike():
    gate, up = randn(128, 64), randn(128, 64)
    for g in ranks(2):
        by_part = MergedColumnParallelLinear(64, [128, 128], g)
        load(by_part, by_part.weight, gate, 0)
        load(by_part, by_part.weight, up, 1)
        mine = slice(g.rank * 64, (g.rank + 1) * 64)
        assert torch.equal(by_part.weight, torch.cat([gate[mine], up[mine]]))
        whole = MergedColumnParallelLinear(64, [128, 128], g)
        load(whole, whole.weight, torch.cat([gate, up]))  # shard None: dummy weights, our names
        assert torch.equal(whole.weight, by_part.weight)


@pytest.mark.parametrize("tp", [2, 4])
def test_qkv_rows_follow_the_heads_with_kv_heads_replicated_past_their_count(tp):
    layout = TPLayout.of(SPEC, tp)
    q, k, v = randn(64, 64), randn(32, 64), randn(32, 64)
    bias = randn(128)
    for g in ranks(tp):
        layer = QKVParallelLinear(64, HD, layout, g, bias=True)
        for i, t in enumerate((q, k, v)):
            load(layer, layer.weight, t, i)
        load(layer, layer.bias, bias)  # the whole fused bias
        qh, kvh = layout.q_heads(g.rank), layout.kv_heads(g.rank)
        qr, kvr = slice(qh.start * HD, qh.stop * HD), slice(kvh.start * HD, kvh.stop * HD)
        assert torch.equal(layer.weight, torch.cat([q[qr], k[kvr], v[kvr]]))
        b_q, b_k, b_v = bias.split([64, 32, 32])
        assert torch.equal(layer.bias, torch.cat([b_q[qr], b_k[kvr], b_v[kvr]]))
    if tp == 4:  # ranks 0 and 1 share KV head 0
        assert list(layout.kv_heads(0)) == list(layout.kv_heads(1)) == [0]


def test_vocab_rows_are_cut_per_rank_with_the_last_rank_zero_padded():
    layout, table = TPLayout.of(SPEC, 4), randn(387, 64)
    parts = []
    for g in ranks(4):
        for layer in (VocabParallelEmbedding(layout, 64, g), ParallelLMHead(layout, 64, g)):
            layer.weight.data.fill_(7.0)  # padding must be overwritten, not left as it was
            load(layer, layer.weight, table)
        parts.append(layer.weight)
    rows = torch.cat(parts)
    assert rows.shape[0] == 4 * 97 and torch.equal(rows[:387], table) and not rows[387:].any()


def test_loaders_refuse_tensors_of_the_wrong_size():
    layer = QKVParallelLinear(64, HD, TPLayout.of(SPEC, 2), TPGroup(0, 2))
    with pytest.raises(ValueError, match="has 48 rows, expected 32"):
        load(layer, layer.weight, randn(48, 64), 1)
    with pytest.raises(ValueError, match="expected 128 .fused."):
        load(layer, layer.weight, randn(100, 64))
    row = RowParallelLinear(128, 64, TPGroup(1, 2))
    with pytest.raises(ValueError, match="expected 128 columns"):
        load(row, row.weight, randn(64, 64))


def build(tp: TPGroup | None = None, spec: ModelSpec = SPEC):
    return model_class(spec.architecture)(spec, 64, tp)


def test_checkpoint_names_and_our_fused_names_load_the_same_rank_weights():
    """Dummy weights at TP n are a single-rank model's full tensors in our names; a
    checkpoint names q/k/v and gate/up apart. Both give every rank the same slice."""
    full = build()
    with torch.no_grad():
        fill_dummy_weights(full, seed=3)
    ours = {n: p.detach() for n, p in full.named_parameters()}
    checkpoint = dict(ours)
    for fused, parts in full.packed_modules.items():
        for name in [n for n in ours if f".{fused}." in n]:
            module = full.get_submodule(name.rsplit(".", 1)[0])
            for part, t in zip(parts, checkpoint.pop(name).split(module.output_sizes), strict=True):
                checkpoint[name.replace(f".{fused}.", f".{part}.")] = t
    for g in ranks(2):
        a, b = build(g), build(g)
        a.load_weights(ours.items())
        b.load_weights(checkpoint.items())
        for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
            assert torch.equal(pa, pb), name


def test_dummy_full_tensors_are_the_single_rank_draws():
    full = build()
    with torch.no_grad():
        fill_dummy_weights(full, seed=5)
    cls = model_class(SPEC.architecture)
    drawn = dict(dummy_full_tensors(cls, SPEC, 64, 5, torch.float32, torch.device("cpu")))
    assert drawn.keys() == dict(full.named_parameters()).keys()
    assert all(torch.equal(drawn[n], p) for n, p in full.named_parameters())


def test_unknown_tensor_wrong_shape_and_missing_tensors_are_errors_naming_them():
    model = build(TPGroup(1, 2))
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.rope.weight' has no place"):
        model.load_weights([("model.layers.0.self_attn.rope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="'model.layers.1.self_attn.k_proj.weight' has 16 rows"):
        model.load_weights([("model.layers.1.self_attn.k_proj.weight", torch.zeros(16, 64))])
    with pytest.raises(ValueError, match="missing tensors: .*'lm_head.weight'"):
        model.load_weights([])
    with pytest.raises(ValueError, match="missing tensors"):  # skipped, not refused
        model.load_weights([("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))])


def test_tied_lm_head_is_the_embedding_and_a_checkpoint_copy_of_it_is_skipped():
    from dataclasses import replace

    spec = replace(SPEC, tie_word_embeddings=True)
    model = build(TPGroup(0, 2), spec)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    full = build(spec=spec)
    with torch.no_grad():
        fill_dummy_weights(full, seed=1)
    weights = [*full.named_parameters(), ("lm_head.weight", torch.ones(3))]
    model.load_weights((n, t.detach()) for n, t in weights)
    assert torch.equal(model.lm_head.weight[:194], full.lm_head.weight[:194])


def test_a_linear_method_computes_every_linear_layer_and_gets_its_after_loading_hook():
    class Doubling(UnquantizedLinearMethod):
        finished = 0

        def apply(self, layer, x, bias, out=None):
            return written_to(out, 2 * super().apply(layer, x, bias))

        def process_weights_after_loading(self, layer):
            Doubling.finished += 1

    method = Doubling()
    model = model_class(SPEC.architecture)(SPEC, 64, linear_method=method)
    linears = [m for m in model.modules() if getattr(m, "method", None) is not None]
    assert len(linears) == 4 * SPEC.num_layers and all(m.method is method for m in linears)
    process_weights_after_loading(model)
    assert Doubling.finished == len(linears)
    layer = ColumnParallelLinear(4, 2, TPGroup.single(), method=method)
    load(layer, layer.weight, torch.ones(2, 4))
    assert torch.equal(layer(torch.ones(1, 4)), torch.full((1, 2), 8.0))


def test_every_supported_architecture_has_a_model_class_and_others_are_refused():
    assert set(SUPPORTED_ARCHITECTURES) <= set(MODELS)
    with pytest.raises(ValueError, match="'GPT2LMHeadModel'.*registered: .*LlamaForCausalLM"):
        model_class("GPT2LMHeadModel")


@pytest.mark.parametrize("bias", [False, True])
def test_a_column_parallel_layer_writes_its_output_into_a_given_buffer(bias):
    layer = ColumnParallelLinear(8, 6, TPGroup.single(), bias=bias)
    with torch.no_grad():
        fill_dummy_weights(layer, seed=3)
    x = torch.randn(5, 8)
    buffer = torch.full((7, 6), float("nan"))
    with torch.no_grad():  # as the engine runs: no autograd through an out= matmul
        out = layer(x, buffer[:5])
        assert out.data_ptr() == buffer.data_ptr()
        assert torch.equal(buffer[:5], layer(x)) and buffer[5:].isnan().all()
