"""The MoE expert computation (`fused_moe`): the routing plan's invariants, the Triton grouped
GEMMs and the `torch._grouped_mm` path against the float32 expert loop, and the benchmark's
smoke run.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET must be set before
the kernel modules are imported); the GPU tests (Qwen3-30B-A3B shapes, CUDA graphs) skip there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from common.model.kernels import fused_moe as fm  # noqa: E402
from common.model.kernels import moe_align as align  # noqa: E402
from common.model.kernels.fused_moe import GemmTiles, GemvConfig, GemvTiles, MoEConfig  # noqa: E402
from common.model.quantization import fp8_ops  # noqa: E402
from common.model.quantization.fp8_experts import ExpertScales  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
ROOT = Path(__file__).resolve().parents[1]
# fp32: summation order only. bf16: the intermediate and each slot's output are rounded once
# to bf16 before the float32 reference's end.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
# Two row blocks per busy expert and a K (= I = 96) that is no multiple of block_k.
SMALL_TILES = MoEConfig(16, GemmTiles(32, 32, 4, 2), GemmTiles(32, 64, 4, 2), group_m=2)
# 32-row blocks whose experts' last blocks, holding at most 16 pairs, multiply 16 rows.
TAIL_TILES = MoEConfig(32, GemmTiles(32, 32, 4, 2), GemmTiles(32, 64, 4, 2), group_m=2, tail_m=16)
# The same, the weights' tiles (and the down GEMM's whole blocks of h) read through TMA.
TMA_TILES = MoEConfig(
    32, GemmTiles(32, 32, 4, 2, tma=True), GemmTiles(32, 64, 4, 2, tma=True), group_m=2, tail_m=16
)


def routing(tokens, experts, top_k, used=None, seed=0, device=DEVICE):
    """Duplicate-free ids per token, drawn from the first `used` experts only (the rest get
    no pair), and positive weights."""
    g = torch.Generator().manual_seed(seed)
    used = used or experts
    ids = torch.empty(0, top_k, dtype=torch.long)
    if tokens:
        ids = torch.stack([torch.randperm(used, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return weights.to(device), ids.to(torch.int32).to(device)


def operands(tokens, experts, top_k, hidden, inter, dtype, used=None, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    weights, ids = routing(tokens, experts, top_k, used, seed, device)
    return (*(t.to(dtype).to(device) for t in (x, w13, w2)), weights, ids)


def assert_plan_is_sound(plan: fm.MoEPlan, ids: torch.Tensor, experts: int) -> None:
    """Every routed pair sits once in its expert's group, in pair order; groups come in expert
    order, padded to block_m; every other row holds the sentinel; blocks name their owner."""
    flat, bm = ids.flatten().tolist(), plan.block_m
    rows, owner = plan.sorted_pairs.tolist(), plan.block_expert.tolist()
    pair_rows, ends = plan.pair_rows.tolist(), plan.expert_ends.tolist()
    assert plan.num_rows == align.max_rows(len(flat), experts, bm)
    start = 0
    for e in range(experts):
        mine = [p for p, i in enumerate(flat) if i == e]
        assert ends[e] - start == -(-len(mine) // bm) * bm
        assert rows[start : start + len(mine)] == mine
        assert set(rows[start + len(mine) : ends[e]]) <= {len(flat)}
        assert set(owner[start // bm : ends[e] // bm]) <= {e}
        start = ends[e]
    assert set(rows[start:]) <= {len(flat)} and set(owner[start // bm :]) <= {-1}
    for p, i in enumerate(flat):
        assert pair_rows[p] == (rows.index(p) if 0 <= i < experts else -1)


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 4, 2, 16), (17, 8, 2, 16),
                                                          (50, 64, 6, 1), (9, 8, 3, 4)])  # fmt: skip
def test_plan_groups_pairs_by_expert_with_padding_rows_pointing_past_the_pairs(
    tokens, experts, top_k, block_m
):
    _, ids = routing(tokens, experts, top_k, used=max(top_k, experts - 3))
    assert_plan_is_sound(fm.moe_align(ids, experts, block_m), ids, experts)


# (tokens, k, block_m, pairs a program): 5 programs; 38 programs sharing 2 tiles of blocks and
# 8 experts' padding (more programs than either).
@pytest.mark.parametrize("tokens,top_k,block_m,per", [(50, 3, 16, 32), (300, 2, 4, 16)])
def test_multi_program_plan_equals_the_one_program_plan(monkeypatch, tokens, top_k, block_m, per):
    _, ids = routing(tokens, 8, top_k, used=6, seed=3)
    ids[4, 1] = -1  # dropped pairs too
    one = fm.moe_align(ids.long(), 8, block_m, one_program=True)
    monkeypatch.setattr(align, "PAIRS_PER_PROGRAM", per)
    many = fm.moe_align(ids, 8, block_m, one_program=False)
    assert_plan_is_sound(many, ids, 8)
    for name in ("sorted_pairs", "block_expert", "pair_rows", "expert_ends"):
        assert torch.equal(getattr(one, name), getattr(many, name)), name


def test_ids_outside_the_experts_drop_their_pair_everywhere():
    dtype = torch.bfloat16 if CUDA else torch.float32  # grouped_mm: bf16 only on CUDA
    x, w13, w2, weights, ids = operands(5, 4, 2, 64, 32, dtype)
    ids[1, 0], ids[3, 1] = -1, 4
    plan = fm.moe_align(ids, 4, 16)
    assert plan.pair_rows[2].item() == -1 and plan.pair_rows[7].item() == -1
    assert_plan_is_sound(plan, ids, 4)
    kept = weights.clone()
    kept[1, 0] = kept[3, 1] = 0.0
    ref = fm.moe_reference(x, w13, w2, kept, ids.clamp(0, 3))
    for impl in ("triton", "grouped_mm", "reference"):
        out = fm.experts_forward(x, w13, w2, weights, ids, impl=impl)
        torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


# (T, E, k, I, dtype, config): T = 1, 3, 17; some experts get no token; uneven K tiles. None
# picks the GEMVs up to GEMV_MAX_TOKENS tokens, the grouped GEMMs beyond.
CASES = [
    (1, 4, 2, 32, torch.float32, None),
    (3, 8, 2, 96, torch.float32, None),
    (3, 8, 2, 96, torch.float32, SMALL_TILES),
    (6, 8, 2, 64, torch.float32, None),
    (17, 8, 2, 64, torch.float32, SMALL_TILES),
    (17, 4, 2, 96, torch.float32, SMALL_TILES),  # 17 rows on each of two experts
    (1, 8, 2, 96, torch.bfloat16, None),
    (17, 8, 2, 32, torch.bfloat16, SMALL_TILES),
    (45, 4, 2, 96, torch.float32, TAIL_TILES),  # two experts, 45 pairs each: 32 + a 13-pair tail
    (21, 4, 2, 64, torch.bfloat16, TAIL_TILES),  # 21 pairs each: one block, multiplied whole
    (45, 4, 2, 96, torch.float32, TMA_TILES),  # TMA: K = I = 96 ends inside a down K tile
    (21, 4, 2, 40, torch.bfloat16, TMA_TILES),  # I = 40: a gate tile runs into the up rows
    (21, 4, 2, 36, torch.bfloat16, TMA_TILES),  # h's 72-byte rows: the down GEMM reads no TMA
]


@pytest.mark.parametrize("tokens,experts,top_k,inter,dtype,config", CASES)
def test_triton_path_matches_the_float32_expert_loop(tokens, experts, top_k, inter, dtype, config):
    args = operands(tokens, experts, top_k, 64, inter, dtype, used=experts - 2)
    out = fm.fused_moe_triton(*args, config=config)
    assert out.dtype == dtype and out.shape == (tokens, 64)
    torch.testing.assert_close(out.float(), fm.moe_reference(*args).float(), **TOL[dtype])


# Not the last case: grouped_mm needs rows of 16-byte multiples.
@pytest.mark.parametrize("tokens,experts,top_k,inter,dtype,_", CASES[:2] + CASES[6:-1])
def test_grouped_mm_path_matches_the_float32_expert_loop(tokens, experts, top_k, inter, dtype, _):
    if CUDA and dtype != torch.bfloat16:
        pytest.skip("grouped_mm runs bf16 only on CUDA")
    args = operands(tokens, experts, top_k, 64, inter, dtype, used=experts - 2)
    out = fm.fused_moe_grouped_mm(*args)
    assert out.dtype == dtype and out.shape == (tokens, 64)
    torch.testing.assert_close(out.float(), fm.moe_reference(*args).float(), **TOL[dtype])


# Column tiles narrower than the GEMMs', K steps that do not divide H = 72 nor I = 40.
SMALL_GEMV = GemvConfig(GemvTiles(8, 32, 2, 2), GemvTiles(16, 16, 4, 3), fill_sms=False)


@pytest.mark.parametrize("config", [SMALL_TILES, SMALL_GEMV])
def test_triton_paths_are_deterministic_and_take_int64_ids(config):
    x, w13, w2, weights, ids = operands(17, 8, 2, 64, 32, torch.bfloat16)
    first = fm.fused_moe_triton(x, w13, w2, weights, ids, config=config)
    again = fm.fused_moe_triton(x, w13, w2, weights, ids.long(), config=config)
    assert torch.equal(first, again)  # slots summed in a fixed order, no atomics


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_path_sums_each_tokens_slots_and_skips_dropped_pairs(dtype):
    x, w13, w2, weights, ids = operands(4, 16, 4, 72, 40, dtype, used=12, seed=5)
    ids[0, 1], ids[3, 3] = -1, 16  # other ranks' experts (expert parallelism)
    kept = weights.clone()
    kept[0, 1] = kept[3, 3] = 0.0
    ref = fm.moe_reference(x, w13, w2, kept, ids.clamp(0, 15))
    for config in (None, SMALL_GEMV):
        out = fm.fused_moe_triton(x, w13, w2, weights, ids, config=config)
        torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_auto_is_the_reference_on_cpu_and_no_tokens_give_an_empty_output():
    args = operands(3, 4, 2, 64, 32, torch.float32, device=torch.device("cpu"))
    assert torch.equal(fm.experts_forward(*args), fm.moe_reference(*args))
    empty = operands(0, 4, 2, 64, 32, torch.bfloat16)
    for impl in ("triton", "grouped_mm"):
        assert fm.experts_forward(*empty, impl=impl).shape == (0, 64)


def test_configs_split_decode_columns_until_the_sms_are_busy():
    w13 = torch.empty(128, 2 * 768, 2048, device="meta")  # Qwen3-30B-A3B
    gemv = fm.pick_config(1, 8, w13, sms=132)
    assert isinstance(gemv, GemvConfig) and fm.GEMV_MAX_TOKENS >= 1
    assert 8 * -(-768 // gemv.gate_up.block_n) >= 132  # a program per pair and column tile
    assert 1 * -(-2048 // gemv.down.block_n) >= 132  # a program per token and column tile
    decode = fm.pick_config(fm.GEMV_MAX_TOKENS + 4, 8, w13, sms=132)
    assert decode.block_m == 16
    assert 64 * -(-768 // decode.gate_up.block_n) >= 132  # 64 row blocks at most
    assert 64 * -(-2048 // decode.down.block_n) >= 132
    prefill = fm.pick_config(2048, 8, w13, sms=132)
    assert prefill.block_m == 128 and prefill.gate_up.tma and prefill.down.tma
    assert prefill == fm.MOE_CONFIGS[-2][1] and not fm.MOE_CONFIGS[-1][1].gate_up.tma
    assert fm.pick_config(8192, 8, w13, sms=132) == fm.MOE_CONFIGS[-1][1]
    blocks = torch.empty(128, 12, 16, device="meta"), torch.empty(128, 16, 6, device="meta")
    fp8 = fm.pick_config(2048, 8, w13, sms=132, scales=ExpertScales(*blocks, 128, 128))
    assert fp8 == fm.FP8_PREFILL_CONFIGS[True]  # the bf16 tiles spill with FP8 block scales


def test_bad_operands_are_refused_naming_the_values():
    x, w13, w2, weights, ids = operands(3, 4, 2, 64, 32, torch.float32)
    with pytest.raises(ValueError, match=r"inconsistent MoE shapes: .*w2 \(4, 64, 16\)"):
        fm.fused_moe_triton(x, w13, w2[:, :, :16], weights, ids)
    with pytest.raises(ValueError, match=r"must be torch.float32 .* got torch.bfloat16, torch.f"):
        fm.fused_moe_triton(x, w13.bfloat16(), w2, weights, ids)
    with pytest.raises(ValueError, match=r"int32 or int64, got torch.float32"):
        fm.moe_align(ids.float(), 4, 16)
    with pytest.raises(ValueError, match=r"impl must be one of .* got 'fast'"):
        fm.experts_forward(x, w13, w2, weights, ids, impl="fast")
    with pytest.raises(ValueError, match=r"block_m must be a power of two >= 16, got 8"):
        fm.fused_moe_triton(
            x, w13, w2, weights, ids, config=dataclasses.replace(SMALL_TILES, block_m=8)
        )


def fp8_experts(w13, w2, group: tuple[int, int] | None):
    """The experts in FP8 with their `ExpertScales`: `group` (n, k) blocks, or per row."""

    def quantize(w):
        pairs = [
            fp8_ops.quantize_weight_blocks(one, group) if group else fp8_ops.quantize_per_token(one)
            for one in w.float()
        ]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])

    (q13, s13), (q2, s2) = quantize(w13), quantize(w2)
    gn, gk = group or (1, 0)
    return q13, q2, ExpertScales(s13, s2, gn, gk)


# (T, E, k, I, dtype, config, scale groups): H = 64, so 32-wide blocks give gate_up 2 K blocks
# and down (K = I = 96) 3; the gate and up halves 3 block rows each. GEMVs and grouped GEMMs,
# float32 and bf16 activations, block and per-row scales.
# FP8 paths against their reference: besides the summation order, an h element that rounds to
# the other side of an FP8 step (its 16-bit value differs in the last bit) moves its outputs by
# up to a step, 2^-4 of that element's share. In bf16 the 16-bit path itself is 0.7% off its
# float32 reference in norm (h, y and out rounded); FP8 measured 1.2% here.
FP8_TOL = {torch.float32: dict(atol=1e-3, rtol=1e-3), torch.bfloat16: dict(atol=6e-2, rtol=6e-2)}
FP8_NORM_TOL = {torch.float32: 1e-4, torch.bfloat16: 0.02}


def assert_fp8_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within FP8_TOL but for at most one element in 10^5 (plus one): at 2048 tokens on an
    H200, 3 of 4.2M elements were up to 0.08 off, each a flipped h element's share."""
    tol, norm_tol = FP8_TOL[ref.dtype], FP8_NORM_TOL[ref.dtype]
    out, ref = out.float(), ref.float()
    far = (out - ref).abs() > tol["atol"] + tol["rtol"] * ref.abs()
    assert int(far.sum()) <= 1 + ref.numel() // 100_000, f"{int(far.sum())} of {ref.numel()}"
    assert (out - ref).norm() <= norm_tol * ref.norm()


FP8_CASES = [
    (1, 8, 2, 96, torch.float32, None, (32, 32)),
    (3, 8, 2, 96, torch.bfloat16, SMALL_GEMV, (32, 32)),
    (17, 8, 2, 96, torch.float32, SMALL_TILES, (32, 32)),
    (17, 8, 2, 96, torch.bfloat16, SMALL_TILES, None),
    (45, 4, 2, 96, torch.bfloat16, TAIL_TILES, (32, 32)),
    (45, 4, 2, 96, torch.bfloat16, TMA_TILES, (32, 32)),
    (45, 4, 2, 96, torch.bfloat16, TMA_TILES, None),
    (2, 8, 2, 96, torch.float32, None, None),
]


@pytest.mark.parametrize("tokens,experts,top_k,inter,dtype,config,group", FP8_CASES)
def test_fp8_experts_equal_the_loop_over_their_dequantized_weights(
    tokens, experts, top_k, inter, dtype, config, group
):
    """W8A8: x and h quantized like the weights' K blocks (per 32 columns here, or per token),
    every FP8 product summed in float32 and scaled per block: the kernels equal the float32
    loop over the dequantized operands (`fp8_experts.reference`) up to summation order, and
    stay within FP8's rounding of the 16-bit experts."""
    x, w13, w2, weights, ids = operands(tokens, experts, top_k, 64, inter, dtype, used=experts - 1)
    q13, q2, scales = fp8_experts(w13, w2, group)
    assert q13.dtype == torch.float8_e4m3fn and scales.w13.shape[1] == (6 if group else 192)
    out = fm.fused_moe_triton(x, q13, q2, weights, ids, config=config, scales=scales)
    ref = fm.moe_reference(x, q13, q2, weights, ids, scales)
    assert_fp8_close(out, ref)
    unquantized = fm.moe_reference(x, w13, w2, weights, ids).float()
    assert (out.float() - unquantized).norm() < 0.1 * unquantized.norm()
    auto = fm.experts_forward(x, q13, q2, weights, ids, scales=scales)
    assert_fp8_close(auto, ref)  # the reference itself on CPU
    with pytest.raises(ValueError, match="grouped_mm multiplies 16-bit experts only"):
        fm.experts_forward(x, q13, q2, weights, ids, impl="grouped_mm", scales=scales)


def test_fp8_expert_scales_of_the_wrong_grid_are_refused():
    x, w13, w2, weights, ids = operands(3, 4, 2, 64, 32, torch.float32)
    q13, q2, scales = fp8_experts(w13, w2, (32, 32))
    wrong = ExpertScales(scales.w13[:, :1], scales.w2, 32, 32)
    with pytest.raises(ValueError, match=r"scales must be w13 \(4, 2, 2\) .* got \(4, 1, 2\)"):
        fm.fused_moe_triton(x, q13, q2, weights, ids, scales=wrong)
    with pytest.raises(ValueError, match=r"must be torch.float8_e4m3fn"):
        fm.fused_moe_triton(x, w13, w2, weights, ids, scales=scales)


def test_benchmark_smoke_run_checks_every_path_and_the_whole_layer(tmp_path):
    out = tmp_path / "moe.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_moe.py"), "--smoke", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {r["impl"] for r in rows} == {"reference", "grouped_mm", "triton"}
    assert all(r["max_rel_err"] < report["tol"] for r in rows if r["impl"] != "reference")
    assert all(r["touched_experts"] >= 1 and r["floor_us"] > 0 for r in rows)
    pieces = report["layer_rows"]  # the whole layer with either router, and each router alone
    assert {r["impl"] for r in pieces} == {
        f"{kind}[{router} router]" for kind in ("router", "layer") for router in ("torch", "fused")
    }
    assert all(r["ids_match"] == 1.0 for r in pieces)
    assert all(r["max_rel_err"] < report["tol"] for r in pieces if r["kind"] == "layer")


gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
QWEN3 = dict(experts=128, top_k=8, hidden=2048, inter=768)  # Qwen3-30B-A3B, one layer


@pytest.fixture(scope="module")
def qwen3_weights():
    torch.manual_seed(0)
    e, h, i = QWEN3["experts"], QWEN3["hidden"], QWEN3["inter"]
    w13 = (torch.randn(e, 2 * i, h, device=DEVICE) * h**-0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device=DEVICE) * i**-0.5).bfloat16()
    return w13, w2


@gpu
@pytest.mark.parametrize("tokens", [1, 4, 32, 128, 2048])
@pytest.mark.parametrize("impl", ["triton", "grouped_mm"])
def test_gpu_paths_match_the_reference_at_qwen3_moe_shapes(qwen3_weights, tokens, impl):
    w13, w2 = qwen3_weights
    x = torch.randn(tokens, QWEN3["hidden"], device=DEVICE).bfloat16()
    weights, ids = routing(tokens, QWEN3["experts"], QWEN3["top_k"], seed=tokens)
    out = fm.experts_forward(x, w13, w2, weights, ids, impl=impl)
    ref = fm.moe_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


@gpu
def test_grouped_mm_refuses_dtypes_that_would_sync_on_cuda():
    args = operands(3, 4, 2, 64, 32, torch.float32)
    with pytest.raises(ValueError, match=r"bf16 only on CUDA .* got torch.float32"):
        fm.fused_moe_grouped_mm(*args)
    assert fm.experts_forward(*args).dtype == torch.float32  # auto takes triton instead


@gpu
@pytest.mark.parametrize("tokens", [2, 32, 2048])  # GEMVs; the plan in one launch, in three
@pytest.mark.parametrize("impl", ["triton", "grouped_mm"])
def test_gpu_paths_replay_in_a_cuda_graph_with_new_routing(qwen3_weights, tokens, impl):
    w13, w2 = qwen3_weights
    x = torch.randn(tokens, QWEN3["hidden"], device=DEVICE).bfloat16()
    weights, ids = routing(tokens, QWEN3["experts"], QWEN3["top_k"], seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fm.experts_forward(x, w13, w2, weights, ids, impl=impl)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.experts_forward(x, w13, w2, weights, ids, impl=impl)
    new_weights, new_ids = routing(tokens, QWEN3["experts"], QWEN3["top_k"], seed=2)
    x.copy_(torch.randn_like(x))
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    ref = fm.moe_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


@gpu
@pytest.mark.parametrize("tokens", [1, 4, 32, 128, 2048])
@pytest.mark.parametrize("group", [(128, 128), None], ids=["block", "row"])
def test_gpu_fp8_experts_match_their_dequantized_reference_in_a_graph(qwen3_weights, tokens, group):
    """Qwen3-30B-A3B's experts in FP8, block or per-row scales: GEMVs (1, 4 tokens), then the
    grouped GEMMs; captured once, replayed with new tokens and routing."""
    q13, q2, scales = fp8_experts(*qwen3_weights, group)
    x = torch.randn(tokens, QWEN3["hidden"], device=DEVICE).bfloat16()
    weights, ids = routing(tokens, QWEN3["experts"], QWEN3["top_k"], seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fm.experts_forward(x, q13, q2, weights, ids, scales=scales)  # compiles outside
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.experts_forward(x, q13, q2, weights, ids, scales=scales)
    new_weights, new_ids = routing(tokens, QWEN3["experts"], QWEN3["top_k"], seed=tokens)
    x.copy_(torch.randn_like(x))
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    ref = fm.moe_reference(x, q13, q2, weights, ids, scales)
    assert_fp8_close(out, ref)
