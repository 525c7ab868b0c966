"""Mixture-of-experts models over several ranks (real rank processes, gloo, CPU, fp32): greedy
output with tensor parallelism (every rank a slice of every expert) and with expert parallelism
(every rank whole experts) equals TP 1 and HF transformers `generate()`, and a PD stack whose
decode node is expert parallel gives the text of the single-process engine.

Tiny random Qwen3-MoE (8 experts, top-2, one dense layer) and Mixtral (4 experts, top-2) are
built by transformers and saved as real HF directories, so the per-expert checkpoint tensors
go through the loaders of both splits. The Qwen3-MoE model carries the embedded tokenizer so
that the router can detokenize.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen3MoeConfig

from common import LLM, SamplingParams
from common.model.source import resolve_model
from common.text.tokenizer import load_tokenizer
from pdserve.cli import main
from pdserve.flags import build_parser
from pdserve.plan import configs_from_args, plan
from tests.hf_oracle import hf_greedy
from tests.pd_stack import PDStack
from tests.tiny_models import TINY_SHAPE

NEW_TOKENS = 10
OPTIONS = dict(device="cpu", block_size=16, max_num_batched_tokens=256, num_kv_blocks=64)
MOE_SHAPE = dict(TINY_SHAPE, max_position_embeddings=512, initializer_range=0.25)


def qwen3_moe(vocab_size: int, num_experts: int = 8) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        **{**MOE_SHAPE, "num_hidden_layers": 3},
        vocab_size=vocab_size,
        head_dim=32,
        num_experts=num_experts,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    )


def mixtral() -> MixtralConfig:
    return MixtralConfig(
        **MOE_SHAPE, vocab_size=384, num_local_experts=4, num_experts_per_tok=2, sliding_window=None
    )


def save(config, folder: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(folder)
    return hf


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 17, 40)]


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory) -> tuple[str, list[list[int]], list[list[int]]]:
    """Qwen3-MoE with the embedded tokenizer, its prompts and HF's greedy continuations."""
    folder = tmp_path_factory.mktemp("qwen3_moe")
    tokenizer = load_tokenizer(resolve_model(None).directory)
    hf = save(qwen3_moe(len(tokenizer)), folder)
    tokenizer.save_pretrained(folder)
    ps = prompts(len(tokenizer))
    return str(folder), ps, [hf_greedy(hf, p, NEW_TOKENS) for p in ps]


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> tuple[str, list[list[int]], list[list[int]]]:
    folder = tmp_path_factory.mktemp("mixtral")
    hf = save(mixtral(), folder)
    ps = prompts(384)
    return str(folder), ps, [hf_greedy(hf, p, NEW_TOKENS) for p in ps]


@pytest.fixture(params=["qwen3_moe", "mixtral"])
def moe_model(request) -> tuple[str, list[list[int]], list[list[int]]]:
    return request.getfixturevalue(f"{request.param}_dir")


def test_greedy_at_tp1_equals_hf(moe_model):
    folder, ps, expected = moe_model
    with LLM(folder, **OPTIONS) as llm:
        assert [o.token_ids for o in llm.generate(ps, greedy())] == expected


def test_tensor_parallel_2_slices_every_expert_and_equals_hf(moe_model):
    folder, ps, expected = moe_model
    with LLM(folder, tp=2, **OPTIONS) as llm:
        experts = llm.engine.worker.model.model.layers[0].mlp.experts
        assert not llm.engine.worker.runtime.expert_parallel
        assert experts.expert_range == range(experts.num_experts)
        assert [o.token_ids for o in llm.generate(ps, greedy())] == expected


def test_expert_parallel_2_holds_half_the_experts_whole_and_equals_hf(moe_model):
    folder, ps, expected = moe_model
    with LLM(folder, tp=2, enable_expert_parallel=True, **OPTIONS) as llm:
        experts = llm.engine.worker.model.model.layers[0].mlp.experts
        assert llm.engine.worker.runtime.expert_parallel
        assert experts.expert_range == range(experts.num_experts // 2)
        assert experts.gate_up_proj.shape[0] == experts.num_experts // 2
        assert [o.token_ids for o in llm.generate(ps, greedy())] == expected


def write_config(config, folder: Path) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(config.to_json_string())
    return str(folder)


def test_expert_parallel_on_a_dense_model_is_refused_naming_it(tmp_path):
    dense = write_config(LlamaConfig(**MOE_SHAPE, vocab_size=384), tmp_path / "llama")
    with pytest.raises(ValueError, match="LlamaForCausalLM is dense"):
        LLM(dense, tp=2, enable_expert_parallel=True, load_format="dummy", **OPTIONS)


def test_expert_parallel_over_ranks_that_do_not_divide_the_experts_is_refused(tmp_path):
    """4 ranks split the heads (4), KV heads (2) and MLPs, but not 6 experts."""
    six = write_config(qwen3_moe(384, num_experts=6), tmp_path / "six")
    with pytest.raises(ValueError, match="tp=4 does not divide the 6 experts"):
        LLM(six, tp=4, enable_expert_parallel=True, load_format="dummy", **OPTIONS)


def test_launcher_flag_reaches_one_pool_and_a_dense_model_stops_before_any_process(
    tmp_path, capsys
):
    args = ["serve", "--decode-tp", "2", "--decode-enable-expert-parallel"]
    configs = configs_from_args(build_parser().parse_args(args))
    prefill, decode = plan(configs, "/m", "m", gpus=0).nodes
    assert "--enable-expert-parallel" in decode.argv
    assert "--enable-expert-parallel" not in prefill.argv
    help_text = build_parser().parse_args(["serve"]).serve_parser.format_help()
    assert "--prefill-enable-expert-parallel" in help_text
    dense = write_config(LlamaConfig(**MOE_SHAPE, vocab_size=384), tmp_path / "llama")
    assert main(["serve", "--model", dense, "--enable-expert-parallel"]) == 2
    assert "LlamaForCausalLM is dense" in capsys.readouterr().err


LAUNCH = ("--num-kv-blocks", "64", "--max-num-batched-tokens", "256", "--max-num-seqs", "8")
PD_PROMPTS = [list(range(100, 140)), [42, 43, 44]]  # 40 tokens: full blocks and a partial one


def completion_text(url: str, prompt: list[int]) -> str:
    body = {
        "model": "model", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
        "ignore_eos": True,
    }  # fmt: skip
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_pd_from_a_tp1_prefill_into_an_expert_parallel_decode_node_gives_the_same_text(
    qwen3_moe_dir, tmp_path
):
    """The KV is the same with and without expert parallelism: the router pairs the pools,
    the one prefill rank's frames reach both decode ranks' pools, and the text is the
    single-process engine's (which colocated serving equals: tests/test_pd_faults.py)."""
    folder = qwen3_moe_dir[0]
    with LLM(folder, device="cpu", num_kv_blocks=64) as llm:
        expected = [o.text for o in llm.generate(PD_PROMPTS, greedy())]
    stack = PDStack(
        "--model", folder, "--served-model-name", "model", "--decode-tp", "2",
        "--decode-enable-expert-parallel", *LAUNCH,
        log_path=tmp_path / "launch.log",
    )  # fmt: skip
    try:
        decode, prefill = stack.node("decode")["info"], stack.node("prefill")["info"]
        assert (decode["tp"], decode["expert_parallel"]) == (2, True)
        assert (prefill["tp"], prefill["expert_parallel"]) == (1, False)
        assert [completion_text(stack.url, p) for p in PD_PROMPTS] == expected
        assert stack.node("decode")["load"].get("kv_transfer_failures", 0) == 0
    finally:
        assert stack.stop() == [], "processes left after Ctrl-C"


def test_moe_parallel_benchmark_smoke_reports_each_layouts_split_and_combine(tmp_path):
    from benchmarks import bench_moe_parallel

    out = tmp_path / "moe"
    argv = ["--smoke", "--no-check", "--layouts", "tp2", "ep2", "--out", str(out)]
    result = bench_moe_parallel.main(argv)
    rows = {(r["layout"], r["batch"]): r for r in result["decode"]}
    assert sorted(rows) == [("ep2", 2), ("ep2", 4), ("tp2", 2), ("tp2", 4)]
    tp2, ep2 = rows["tp2", 4], rows["ep2", 4]
    assert (tp2["experts_per_rank"], tp2["expert_intermediate_per_rank"]) == (8, 16)
    assert (ep2["experts_per_rank"], ep2["expert_intermediate_per_rank"]) == (4, 32)
    assert all("all_reduce" in r["combine"] and r["step_s"] > 0 for r in rows.values())
    assert out.with_suffix(".json").exists()
