"""Expert routing equals transformers' routers, rule by rule; the fused Triton router
(`moe_router.route`) equals `select_experts` on every rule; the stacked experts load the
published per-expert tensors (TP slices and expert-parallel ranks included).

Without CUDA the router kernel runs in Triton's CPU interpreter (TRITON_INTERPRET is set before
the kernel module is imported); the GPU tests (published models' shapes, a CUDA graph) skip."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from transformers import DeepseekV2Config, DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from common.model.distributed import TPGroup  # noqa: E402
from common.model.kernels import moe_router  # noqa: E402
from common.model.kernels.moe_router import RouteTiles, route  # noqa: E402
from common.model.layers.moe import Experts, Router, experts_reference  # noqa: E402
from common.model.layers.moe_routing import select_experts  # noqa: E402
from common.model.spec import MoESpec, moe_spec  # noqa: E402

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


CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
QWEN3 = MoESpec(num_experts=128, top_k=8, intermediate_size=768)
DEEPSEEK_V3 = MoESpec(
    num_experts=256, top_k=8, intermediate_size=2048, scoring="sigmoid", num_groups=8,
    topk_groups=4, group_score="top2_sum", correction_bias=True, routed_scaling=2.5,
)  # fmt: skip
V2_LITE = MoESpec(num_experts=64, top_k=6, intermediate_size=1408, renormalize=False)
# Small stand-ins of every rule for the interpreter.
RULES = {
    "softmax_renorm": MoESpec(num_experts=16, top_k=4, intermediate_size=8),
    "softmax_scaled": MoESpec(
        num_experts=16, top_k=3, intermediate_size=8, renormalize=False, routed_scaling=16.0
    ),
    "groups_max": MoESpec(
        num_experts=16,
        top_k=4,
        intermediate_size=8,
        num_groups=4,
        topk_groups=2,
        renormalize=False,
        routed_scaling=16.0,
    ),  # fmt: skip
    "v3_sigmoid_top2_bias": MoESpec(
        num_experts=32,
        top_k=4,
        intermediate_size=8,
        scoring="sigmoid",
        num_groups=8,
        topk_groups=3,
        group_score="top2_sum",
        correction_bias=True,
        routed_scaling=2.5,
    ),  # fmt: skip
    "eight_experts": MoESpec(num_experts=8, top_k=2, intermediate_size=8),
}


def gate_inputs(spec: MoESpec, tokens, hidden, dtype=torch.float32, w_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.randn(spec.num_experts, hidden, generator=g) * hidden**-0.5).to(w_dtype or dtype)
    bias = torch.randn(spec.num_experts, generator=g) * 0.3 if spec.correction_bias else None
    return x.to(DEVICE), w.to(DEVICE), None if bias is None else bias.to(DEVICE)


def assert_routes_like_select_experts(x, w, spec, bias, got, near_tie=1e-5, max_ties=0.01):
    """The same experts (as sets) and weights as the oracle on x @ w.T (float64 on the CPU:
    no TF32); a row may differ only where two choices are within `near_tie` (summation order
    decides), and such rows are rare."""
    x, w, bias = x.cpu(), w.cpu(), None if bias is None else bias.cpu()
    logits = torch.nn.functional.linear(x.double(), w.double()).float()
    ref_w, ref_ids = select_experts(logits, spec, bias)
    weights, ids = got[0].cpu(), got[1].cpu()
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (x.shape[0], spec.top_k)
    ids, ref_ids = ids.long().sort(dim=1), ref_ids.long().sort(dim=1)
    same = (ids.values == ref_ids.values).all(dim=1)
    scores = logits.softmax(-1) if spec.scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    for row in (~same).nonzero().flatten().tolist():
        mine = choice[row, ids.values[row]].sort().values
        theirs = choice[row, ref_ids.values[row]].sort().values
        torch.testing.assert_close(mine, theirs, atol=near_tie, rtol=0)
    assert (~same).float().mean().item() <= max_ties
    got_w = weights.gather(1, ids.indices)[same]
    # float32 logits summed over up to 7168 products in the kernel's order: one weight in 65536
    # of DeepSeek-V3's 8192-token case was 1.7e-5 off relatively (H200)
    torch.testing.assert_close(got_w, ref_w.gather(1, ref_ids.indices)[same], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("tokens", [1, 3, 20])  # experts split (FMA), and tl.dot blocks
def test_fused_router_equals_select_experts(rule, tokens):
    spec = RULES[rule]
    x, w, bias = gate_inputs(spec, tokens, 96, seed=tokens)  # 96: no multiple of block_k
    assert_routes_like_select_experts(x, w, spec, bias, route(x, w, spec, bias))


def test_fused_router_reads_bf16_and_mixed_dtypes_and_strided_rows():
    spec = RULES["v3_sigmoid_top2_bias"]
    x, w, bias = gate_inputs(spec, 21, 64, torch.bfloat16)
    assert_routes_like_select_experts(x, w, spec, bias, route(x, w, spec, bias))
    x, w, bias = gate_inputs(spec, 3, 64, torch.bfloat16, w_dtype=torch.float32, seed=1)
    wide = torch.zeros(3, 80, dtype=x.dtype, device=DEVICE)
    wide[:, :64] = x
    assert_routes_like_select_experts(x, w, spec, bias, route(wide[:, :64], w, spec, bias))


@pytest.mark.parametrize(
    "tiles",
    [
        RouteTiles(4, 1, 32),
        RouteTiles(4, 8, 64),
        RouteTiles(16, 2, 16, num_warps=8),
        RouteTiles(64, 1, 64, num_warps=4, num_stages=4),  # a prefill tile
    ],
)
def test_split_and_whole_launches_route_alike_and_leave_their_tickets_at_zero(tiles):
    spec = RULES["v3_sigmoid_top2_bias"]
    x, w, bias = gate_inputs(spec, 7, 64, seed=2)
    for _ in range(2):  # the second call starts from the tickets the first left
        assert_routes_like_select_experts(x, w, spec, bias, route(x, w, spec, bias, tiles=tiles))
    assert not moe_router._tickets(x.device).any()


def test_route_tiles_split_decode_over_the_sms_and_keep_prefill_whole():
    decode = moe_router.pick_route_tiles(1, 128, 2048, sms=132)
    assert (decode.block_t, decode.splits) == (1, 128)  # one expert's logits per program
    mid = moe_router.pick_route_tiles(128, 128, 2048, sms=132)
    assert mid.block_t == 16 and mid.splits * 8 <= 128 and 128 // mid.splits >= 16  # tl.dot
    prefill = moe_router.pick_route_tiles(8192, 256, 7168, sms=132)
    assert prefill.splits == 1 and prefill.block_t * 256 <= 2 * moe_router.REGISTER_TILE
    wide = moe_router.pick_route_tiles(8192, 128, 2048, sms=132)
    assert (wide.block_t, wide.splits) == (64, 1)  # 128 blocks of 64 tokens: one per SM


def test_route_refuses_bad_operands_naming_them():
    spec = RULES["softmax_renorm"]
    x, w, _ = gate_inputs(spec, 2, 32)
    assert route(x[:0], w, spec)[1].shape == (0, 4)
    with pytest.raises(
        ValueError, match=r"x \[T, H\] and gate_weight \[E, H\], got \(2, 32\), \(16, 31\)"
    ):
        route(x, w[:, :31], spec)
    with pytest.raises(ValueError, match="gate_weight has 8 experts, the MoESpec 16"):
        route(x, w[:8], spec)
    with pytest.raises(ValueError, match=r"correction_bias must be \[16\], got \(8,\)"):
        route(x, w, spec, torch.zeros(8, device=DEVICE))
    with pytest.raises(ValueError, match="float tensors"):
        route(x.int(), w, spec)
    with pytest.raises(ValueError, match="must split 16 padded experts"):
        route(x, w, spec, tiles=RouteTiles(16, 2, 32))  # 8 experts per tl.dot program


gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
PUBLISHED = {"qwen3_30b_a3b": (QWEN3, 2048), "deepseek_v3": (DEEPSEEK_V3, 7168),
             "deepseek_v2_lite": (V2_LITE, 2048)}  # fmt: skip


@gpu
@pytest.mark.parametrize("model", list(PUBLISHED))
@pytest.mark.parametrize("tokens", [1, 4, 5, 32, 128, 2048, 8192])
def test_fused_router_equals_select_experts_at_published_shapes(model, tokens):
    spec, hidden = PUBLISHED[model]
    x, w, bias = gate_inputs(spec, tokens, hidden, torch.bfloat16, seed=tokens)
    assert_routes_like_select_experts(x, w, spec, bias, route(x, w, spec, bias))


@gpu
def test_fused_router_replays_in_a_cuda_graph_with_new_inputs():
    spec, hidden = DEEPSEEK_V3, 7168
    x, w, bias = gate_inputs(spec, 4, hidden, torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        route(x, w, spec, bias)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = route(x, w, spec, bias)
    for seed in (1, 2):
        fresh, _, _ = gate_inputs(spec, 4, hidden, torch.bfloat16, seed=seed)
        x.copy_(fresh)
        graph.replay()
        assert_routes_like_select_experts(x, w, spec, bias, got)
    assert not moe_router._tickets(x.device).any()


@gpu
def test_router_module_routes_on_the_gpu_as_on_the_cpu():
    spec = RULES["v3_sigmoid_top2_bias"]
    router = Router(spec, 64)
    torch.nn.init.normal_(router.weight, std=0.3)
    torch.nn.init.normal_(router.e_score_correction_bias, std=0.3)
    x = torch.randn(9, 64)
    on_cpu = router(x)
    on_gpu = router.cuda()(x.cuda())
    bias = router.e_score_correction_bias
    assert_routes_like_select_experts(x, router.weight.detach(), spec, bias.detach(), on_gpu)
    assert torch.equal(on_gpu[1].cpu().sort(1).values, on_cpu[1].sort(1).values)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_float32_logits_are_the_float32_matmul_of_the_same_values(device):
    """Large steps' router logits (`float32_logits`): on CUDA a 16-bit GEMM with a float32
    output, equal to the widened float32 matmul up to the order of its sums; on CPU that
    matmul itself."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from common.model.layers.moe import float32_logits

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4096, 2048, generator=gen).to(device, torch.bfloat16)
    w = (0.02 * torch.randn(128, 2048, generator=gen)).to(device, torch.bfloat16)
    logits = float32_logits(x, w)
    want = torch.nn.functional.linear(x.float(), w.float())
    assert logits.dtype == torch.float32
    if device == "cpu":
        assert torch.equal(logits, want)
    else:
        assert (logits - want).abs().max().item() <= 1e-5 * want.abs().max().item()
