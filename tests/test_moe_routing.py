"""Expert routing equals transformers' routers, rule by rule, and the stacked experts load
the published per-expert tensors (TP slices and expert-parallel ranks included)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from common.model.distributed import TPGroup
from common.model.layers.moe import Experts, experts_reference
from common.model.layers.moe_routing import select_experts
from common.model.spec import MoESpec, moe_spec

HIDDEN, TOKENS = 32, 40


def _same_choice(ours, theirs):
    (w, ids), (tw, tids) = ours, theirs
    order, torder = ids.long().sort(dim=-1), tids.sort(dim=-1)
    assert torch.equal(order.values, torder.values)
    w = w.gather(1, order.indices)
    tw = tw.gather(1, torder.indices)
    torch.testing.assert_close(w, tw.float(), rtol=1e-6, atol=1e-7)


def _route_like_hf(hf_router, spec: MoESpec, bias=None):
    torch.manual_seed(1)
    torch.nn.init.normal_(hf_router.weight, std=0.3)
    x = torch.randn(TOKENS, HIDDEN)
    _, tw, tids = hf_router(x)
    logits = torch.nn.functional.linear(x.float(), hf_router.weight.float())
    return select_experts(logits, spec, bias), (tw, tids)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_routing(method):
    config = DeepseekV2Config(
        architectures=["DeepseekV2ForCausalLM"], hidden_size=HIDDEN, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, topk_method=method,
        routed_scaling_factor=16.0, num_hidden_layers=2, first_k_dense_replace=1,
        moe_intermediate_size=8, n_shared_experts=2,
    )  # fmt: skip
    spec = moe_spec("DeepseekV2ForCausalLM", config)
    assert spec.dense_layers == {0} and spec.shared_intermediate_size == 16
    assert spec.num_groups == (4 if method != "greedy" else 1)
    _same_choice(*_route_like_hf(DeepseekV2TopkRouter(config), spec))


def test_deepseek_v3_routing_with_correction_bias():
    config = DeepseekV3Config(
        architectures=["DeepseekV3ForCausalLM"], hidden_size=HIDDEN, n_routed_experts=32,
        num_experts_per_tok=4, n_group=8, topk_group=3, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_hidden_layers=4, first_k_dense_replace=2,
        moe_intermediate_size=8,
    )  # fmt: skip
    spec = moe_spec("DeepseekV3ForCausalLM", config)
    assert (spec.scoring, spec.group_score, spec.correction_bias) == ("sigmoid", "top2_sum", True)
    router = DeepseekV3TopkRouter(config)
    torch.manual_seed(2)
    router.e_score_correction_bias.copy_(torch.randn(32) * 0.5)  # strong enough to change picks
    _same_choice(*_route_like_hf(router, spec, router.e_score_correction_bias))


def test_renormalized_softmax_top_k():
    spec = MoESpec(num_experts=8, top_k=2, intermediate_size=8, renormalize=True)
    logits = torch.randn(TOKENS, 8)
    w, ids = select_experts(logits, spec)
    probs = logits.softmax(-1)
    top = probs.topk(2, dim=-1)
    torch.testing.assert_close(w, top.values / top.values.sum(-1, keepdim=True))
    assert torch.equal(ids.long(), top.indices)


def _per_expert_tensors(spec: MoESpec, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, i = spec.num_experts, spec.intermediate_size
    return {
        (e, part): torch.randn((i, HIDDEN) if part != "down" else (HIDDEN, i), generator=g)
        for e in range(n)
        for part in ("gate", "up", "down")
    }


def _load(experts: Experts, tensors) -> None:
    shard = {"gate": 0, "up": 1}
    for (e, part), t in tensors.items():
        if part == "down":
            experts.down_proj.weight_loader(experts.down_proj, t, (e, 0))
        else:
            experts.gate_up_proj.weight_loader(experts.gate_up_proj, t, (e, shard[part]))
    assert experts.missing() == []


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_sum_to_one_rank(expert_parallel):
    """TP 2 (intermediate split) and EP 2 (experts split): the ranks' partial sums add up to
    the single rank's output, for tokens routed everywhere."""
    spec = MoESpec(num_experts=4, top_k=2, intermediate_size=16)
    tensors = _per_expert_tensors(spec)
    whole = Experts(spec, HIDDEN, TPGroup.single())
    _load(whole, tensors)
    ranks = [Experts(spec, HIDDEN, TPGroup(r, 2, expert_parallel=expert_parallel)) for r in (0, 1)]
    for rank in ranks:
        _load(rank, tensors)
    x = torch.randn(9, HIDDEN)
    w, ids = select_experts(torch.randn(9, 4), spec)
    expected = whole(x, w, ids)
    torch.testing.assert_close(ranks[0](x, w, ids) + ranks[1](x, w, ids), expected)
    if expert_parallel:  # whole experts: rank 1 holds experts 2 and 3 only
        assert ranks[1].gate_up_proj.shape[0] == 2 and ranks[1].expert_range == range(2, 4)


def test_reference_matches_dense_per_token_loop():
    spec = MoESpec(num_experts=4, top_k=2, intermediate_size=16)
    tensors = _per_expert_tensors(spec, seed=3)
    experts = Experts(spec, HIDDEN, TPGroup.single())
    _load(experts, tensors)
    x = torch.randn(5, HIDDEN)
    w, ids = select_experts(torch.randn(5, 4), spec)
    silu = torch.nn.functional.silu
    want = torch.zeros(5, HIDDEN)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            h = silu(tensors[(e, "gate")] @ x[t]) * (tensors[(e, "up")] @ x[t])
            want[t] += w[t, j] * (tensors[(e, "down")] @ h)
    got = experts_reference(x, experts.gate_up_proj, experts.down_proj, w, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_missing_expert_is_named():
    spec = MoESpec(num_experts=2, top_k=1, intermediate_size=8)
    experts = Experts(spec, HIDDEN, TPGroup.single())
    tensors = _per_expert_tensors(spec)
    del tensors[(1, "up")]
    shard = {"gate": 0, "up": 1}
    for (e, part), t in tensors.items():
        param = experts.down_proj if part == "down" else experts.gate_up_proj
        param.weight_loader(param, t, (e, 0 if part == "down" else shard[part]))
    assert experts.missing() == ["expert 1 gate_up_proj[1]"]
    with pytest.raises(ValueError, match="expert 5 of 2"):
        experts.down_proj.weight_loader(experts.down_proj, tensors[(0, "down")], (5, 0))
