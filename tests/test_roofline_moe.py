"""The engine benchmark's floors for mixture-of-experts and MLA models, on a tiny random
Qwen3-MoE (16 experts, top 4, layer 0 dense): a decode step reads every non-expert weight plus
the experts its tokens touch, counted by the routers' own picks or by the uniform-routing
expectation; a prefill runs top_k experts per token; MLA's attention FLOPs are the absorbed
form's; the KV-capacity arithmetic; and the CPU smoke run of `bench_engine.py --tiny`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks import bench_engine
from benchmarks.decode_loop import LoopResult
from benchmarks.engine_floors import decode_floors
from benchmarks.kv_capacity import kv_capacity, meta_weight_bytes
from benchmarks.moe_configs import TINY, write_tiny
from benchmarks.roofline import (
    attention_flops,
    expert_bytes,
    expert_layers,
    matmul_params,
    prefill_floors,
    routed_experts,
    step_weight_bytes,
    uniform_touched,
    weight_bytes,
)
from common.engine.config import EngineConfig
from common.engine.worker import Worker
from common.model.layers.moe import MoEBlock
from common.model.layers.moe_routing import select_experts
from common.model.loader import build_model
from common.model.source import read_spec, resolve_model
from common.model.spec import MLASpec
from tests.pd_stack import ROOT

CEIL = {"copy_bytes_per_s": 1e12, "bf16_flops_per_s": 1e14, "fp8_flops_per_s": None}
CFG = TINY["qwen3-moe"]
E, K, H, INTER = CFG["num_experts"], CFG["num_experts_per_tok"], CFG["hidden_size"], 32
MOE_LAYERS = CFG["num_hidden_layers"] - len(CFG["mlp_only_layers"])
ONE_EXPERT = 3 * H * INTER * 4  # gate, up and down of one expert, float32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    source = resolve_model(str(write_tiny("qwen3-moe", tmp_path_factory.mktemp("tiny"))))
    spec = read_spec(source)
    model = build_model(spec, source, max_positions=256, dtype=torch.float32,
                        device=torch.device("cpu"), load_format="dummy")  # fmt: skip
    return spec, model


def test_a_decode_step_reads_non_expert_weights_plus_the_touched_experts(tiny):
    _, model = tiny
    layers = expert_layers(model)
    assert len(layers) == MOE_LAYERS and CFG["moe_intermediate_size"] == INTER
    assert all(expert_bytes(e) == ONE_EXPERT for e in layers)
    every = weight_bytes(model)
    assert step_weight_bytes(model, [E] * MOE_LAYERS) == every == step_weight_bytes(model, None)
    none = step_weight_bytes(model, [0] * MOE_LAYERS)
    assert every - none == MOE_LAYERS * E * ONE_EXPERT
    assert step_weight_bytes(model, [K, 11]) == none + (K + 11) * ONE_EXPERT
    with pytest.raises(ValueError, match="touched experts for 1 layers, the model has 2"):
        step_weight_bytes(model, [4])


def test_uniform_routing_touches_top_k_for_one_token_and_all_experts_for_many(tiny):
    _, model = tiny
    assert uniform_touched(model, 1) == [pytest.approx(K)] * MOE_LAYERS
    assert uniform_touched(model, 4) == [pytest.approx(E * (1 - (1 - K / E) ** 4))] * MOE_LAYERS
    assert uniform_touched(model, 4)[0] == pytest.approx(10.9375)  # 16 * (1 - 0.75^4)
    assert uniform_touched(model, 200)[0] == pytest.approx(E, rel=1e-12)


def test_measured_touched_experts_are_the_routers_distinct_picks(tiny):
    _, model = tiny
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    torch.manual_seed(0)
    xs = [torch.randn(5, H) for _ in blocks]
    expected = [
        select_experts(torch.nn.functional.linear(x, b.gate.weight), b.gate.moe)[1].unique().numel()
        for x, b in zip(xs, blocks, strict=True)
    ]
    with torch.inference_mode():
        counts = routed_experts(model, lambda: [b.gate(x) for x, b in zip(xs, blocks, strict=True)])
    assert counts == expected and all(K <= c <= E for c in counts)
    with torch.inference_mode(), pytest.raises(ValueError, match=r"layers \[1\] did not run"):
        routed_experts(model, lambda: blocks[0].gate(xs[0]))


def test_prefill_counts_top_k_experts_per_token_and_the_touched_experts_bytes(tiny):
    spec, model = tiny
    dense = sum(
        p.numel()
        for n, p in model.named_parameters()
        if p.dim() == 2 and "embed_tokens" not in n and "lm_head" not in n
    )
    active = dense + MOE_LAYERS * K * ONE_EXPERT // 4
    assert matmul_params(model) == (active, 0)
    n = 2
    floors = prefill_floors(model, spec, n, CEIL)
    attention = n * n / 2 * 4 * spec.head_dim * spec.num_heads * spec.num_layers
    flops = 2 * n * active + 2 * spec.vocab_size * H + attention
    assert floors["flop_floor_s"] == pytest.approx(flops / CEIL["bf16_flops_per_s"], rel=1e-12)
    touched = E * (1 - (1 - K / E) ** n)
    read = step_weight_bytes(model, [0] * MOE_LAYERS) + MOE_LAYERS * touched * ONE_EXPERT
    assert floors["weight_floor_s"] == pytest.approx(read / CEIL["copy_bytes_per_s"], rel=1e-12)


def test_mla_attention_flops_are_the_absorbed_forms_and_its_kv_is_the_latent(tiny):
    spec, _ = tiny
    lite = MLASpec(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128)  # fmt: skip
    mla = dataclasses.replace(spec, mla=lite, num_heads=16, num_kv_heads=1, head_dim=192)
    per_pair = 2 * (512 + 64) + 2 * 512  # score over latent + rope key, output over the latent
    assert attention_flops(mla, 10) == 10 * per_pair * 16 * spec.num_layers
    assert attention_flops(spec, 10) == 10 * 4 * spec.head_dim * spec.num_heads * spec.num_layers
    assert mla.kv_bytes_per_token(2) == spec.num_layers * 576 * 2


def test_kv_capacity_counts_whole_block_sequences_beside_the_weights(tiny):
    spec, _ = tiny
    qwen_spec, qwen_weights = meta_weight_bytes(str(ROOT / "benchmarks/configs/qwen2.5-7b-instruct"),
                                                torch.bfloat16)  # fmt: skip
    assert qwen_weights == pytest.approx(2 * 7.61e9, rel=0.01)
    memory = 80 * 2**30
    qwen = kv_capacity(qwen_spec, qwen_weights, memory, [1024, 1000])
    assert qwen["kv_bytes_per_token"] == 28 * 2 * 4 * 128 * 2
    assert qwen["sequences"]["1024"] == (memory - qwen_weights) // (1024 * 57344)
    assert qwen["sequences"]["1000"] == (memory - qwen_weights) // (1008 * 57344)  # 63 blocks
    lite = MLASpec(None, 512, 128, 64, 128)
    mla = dataclasses.replace(qwen_spec, mla=lite)
    latent = kv_capacity(mla, qwen_weights, memory, [1024])
    assert latent["kv_cache"] == "latent 1 x 576"
    assert latent["sequences"]["1024"] == (memory - qwen_weights) // (1024 * 28 * 576 * 2)
    with pytest.raises(ValueError, match="leave no KV"):
        kv_capacity(qwen_spec, memory, memory, [1024])


def test_decode_floors_are_the_bytes_read_at_the_copy_rate_measured_and_uniform(tmp_path):
    directory = str(write_tiny("qwen3-moe", tmp_path / "tiny"))
    worker = Worker(EngineConfig.from_options(model=directory, load_format="dummy", device="cpu",
                                              dtype="float32", num_kv_blocks=64))  # fmt: skip
    model, spec = worker.model, worker.spec
    loop = LoopResult(batch=4, steps=10, step_s=0.01, mean_context=100.0, mean_running=4.0,
                      admitted=0)  # fmt: skip
    row = decode_floors(worker, CEIL, loop, [9, 12])
    kv = 4 * 100 * spec.kv_bytes_per_token(4)
    non_expert = step_weight_bytes(model, [0] * MOE_LAYERS)
    assert row["floor_bytes"] == pytest.approx(non_expert + 21 * ONE_EXPERT + kv, rel=1e-12)
    assert row["hbm_floor_s"] == pytest.approx(row["floor_bytes"] / 1e12, rel=1e-12)
    uniform = E * (1 - (1 - K / E) ** 4)
    assert row["touched_experts_uniform"] == pytest.approx(uniform)
    read = non_expert + MOE_LAYERS * uniform * ONE_EXPERT + kv
    assert row["hbm_floor_uniform_s"] == pytest.approx(read / 1e12, rel=1e-12)
    active, _ = matmul_params(model)
    flops = 2 * 4 * active + 2 * 4 * spec.vocab_size * H + attention_flops(spec, 400)
    assert row["flop_floor_s"] == pytest.approx(flops / 1e14, rel=1e-12)
    dense = decode_floors(worker, None, loop, None)  # no ceilings (CPU): bytes only
    assert dense["floor_bytes"] == pytest.approx(weight_bytes(model) + kv, rel=1e-12)
    assert dense["hbm_floor_s"] is None and dense["touched_experts_uniform"] is None


def test_engine_benchmark_smoke_reports_touched_experts_and_moe_floor_bytes(tmp_path):
    result = bench_engine.main(
        ["--smoke", "--tiny", "qwen3-moe", "--parts", "decode", "--mixes", "greedy",
         "--no-compare-sync", "--contexts", "40", "--out", str(tmp_path / "engine")]
    )  # fmt: skip
    experts = result["engine"]["experts"]
    assert experts["moe_layers"] == MOE_LAYERS and experts["num_experts"] == E
    assert (experts["top_k"], experts["expert_bytes"]) == (K, ONE_EXPERT)
    rows = {r["batch"]: r for r in result["decode"]}
    assert set(rows) == {1, 4} and all(r["context"] == 40 for r in rows.values())
    assert rows[1]["touched_experts"] == [K] * MOE_LAYERS  # one token picks k distinct experts
    assert all(K <= n <= E for n in rows[4]["touched_experts"])
    assert rows[4]["touched_experts_uniform"] == pytest.approx(E * (1 - (1 - K / E) ** 4))
    for r in rows.values():
        kv = r["mean_running"] * r["mean_context"] * result["engine"]["kv_bytes_per_token"]
        weights = experts["non_expert_bytes"] + sum(r["touched_experts"]) * ONE_EXPERT
        assert r["floor_bytes"] == pytest.approx(weights + kv, rel=1e-12)


def test_engine_benchmark_skips_a_family_this_checkout_cannot_build(tmp_path):
    result = bench_engine.main(["--smoke", "--tiny", "deepseek-v2", "--out", str(tmp_path / "d")])
    if "skipped" in result:
        assert "DeepseekV2ForCausalLM" in result["skipped"]
    else:  # the DeepSeek model is merged: its run reports the latent cache and its experts
        assert result["engine"]["kv_cache"].startswith("latent")
        assert result["engine"]["experts"]["moe_layers"] == 2
