"""Tiny random DeepSeek-V2 and -V3 models (multi-head latent attention, a paged latent KV
cache, experts with shared experts) built by transformers and saved with `save_pretrained`
(published tensor names): greedy output equals HF `generate()` in fp32, with MLA's prefill in
either form (`--mla-prefill`).

The cache holds the real models' 576 values per token per layer (kv_lora_rank 512 + rope 64),
one plane; everything else is tiny. One engine per model runs every prompt with a 40-token
step budget, so long prompts and prefix-cache hits run as chunks mixed with decode steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the triton case below runs in the CPU interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from common import LLM, SamplingParams  # noqa: E402
from common.engine.kv_cache import block_bytes  # noqa: E402
from common.model.attention import create_backend, mla_prefill, torch_backend  # noqa: E402
from common.model.attention.base import AttentionMetadata, LatentProjection  # noqa: E402
from common.model.attention.selection import choose_backend  # noqa: E402
from common.model.layers.basic import rope_inv_freq  # noqa: E402
from common.model.source import ModelSource, read_spec, stated_config  # noqa: E402
from common.model.spec import ModelSpec  # noqa: E402
from tests.hf_oracle import hf_greedy  # noqa: E402
from tests.test_spec_decode_engine import VOCAB, OracleProposer  # noqa: E402

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    initializer_range=0.25,
    kv_lora_rank=512,
    qk_nope_head_dim=32,
    qk_rope_head_dim=64,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,  # layer 0 dense, layer 1 experts
)


def yarn(mscale: float, mscale_all_dim: float) -> dict:
    return {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
    }


CONFIGS = {
    "v2_greedy": lambda: DeepseekV2Config(
        **COMMON,
        q_lora_rank=None,
        n_shared_experts=2,
        topk_method="greedy",
        routed_scaling_factor=1.5,
    ),  # fmt: skip
    # V2's published yarn: equal mscales, so only the softmax scale changes.
    "v2_group_limited_yarn": lambda: DeepseekV2Config(
        **COMMON,
        q_lora_rank=None,
        n_shared_experts=2,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        rope_scaling=yarn(0.707, 0.707),
    ),  # fmt: skip
    # Unequal mscales: cos and sin are scaled too.
    "v3_lora_yarn": lambda: DeepseekV3Config(
        **COMMON,
        q_lora_rank=32,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_scaling=yarn(1.0, 0.8),
    ),  # fmt: skip
}
OPTIONS = dict(device="cpu", block_size=16, max_num_batched_tokens=40)
KV_BYTES = 16 << 20
NEW_TOKENS = 8
PROMPT_LENGTHS = [1, 15, 16, 17, 33, 100]


def random_prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def build(name: str, folder) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32).eval()
    with torch.no_grad():
        for module in hf.modules():  # V3's router: a bias that changes which experts win
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0.0, 0.5)
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = build(request.param, folder)
    ours = LLM(str(folder), kv_cache_memory_bytes=KV_BYTES, **OPTIONS)
    return request.param, hf, str(folder), ours


def test_kv_pool_holds_one_latent_plane_of_576_values_per_token(tiny):
    _, hf, _, ours = tiny
    worker = ours.engine.worker
    assert worker.spec.architecture == hf.config.architectures[0]
    pool = worker.kv_cache.pool
    assert pool.shape[:2] == (2, 1) and pool.shape[3:] == (16, 1, 576)
    assert worker.kv_cache.k_caches == [] and len(worker.kv_cache.latent_caches) == 2
    assert block_bytes(worker.rank_spec, 16, torch.float32) == 2 * 576 * 16 * 4


def test_config_json_is_read_without_transformers_and_matches_it(tiny):
    _, _, folder, _ = tiny
    directory = Path(folder)
    assert stated_config(json.loads((directory / "config.json").read_text())) is not None
    via_transformers = ModelSpec.from_hf_config(AutoConfig.from_pretrained(directory))
    assert read_spec(ModelSource(directory, "tiny")) == via_transformers


def test_softmax_scale_is_hf_attentions(tiny):
    _, hf, _, ours = tiny
    assert ours.engine.worker.runner.scale == pytest.approx(
        hf.model.layers[0].self_attn.scaling, rel=1e-12
    )


def test_greedy_equals_hf_for_prompts_around_block_boundaries(tiny):
    _, hf, _, ours = tiny
    prompts = [random_prompt(n, seed=n) for n in PROMPT_LENGTHS]
    outputs = ours.generate(prompts, greedy())
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, NEW_TOKENS), len(prompt)


def test_prefix_cache_hit_then_chunked_prefill_gives_hf_output(tiny):
    """The second prompt reads 48 cached tokens' latents, then its 60 new ones run as two
    chunks (40-token budget), the second chunk attending to the first's cached rows."""
    _, hf, _, ours = tiny
    shared = random_prompt(48, seed=7)
    ours.generate(shared + random_prompt(5, seed=8), greedy())
    second = shared + random_prompt(60, seed=9)
    out = ours.generate(second, greedy())[0]
    assert out.num_cached_tokens >= 48
    assert out.token_ids == hf_greedy(hf, second, NEW_TOKENS)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v3_lora_yarn_alone")
    hf = build("v3_lora_yarn", folder)
    return hf, str(folder)


def test_cpu_graph_paths_give_hf_output(v3):
    """Decode graphs and piecewise prefill graphs (on CPU: their static buffers, run
    eagerly) with MLA's shapes."""
    hf, folder = v3
    llm = LLM(folder, kv_cache_memory_bytes=KV_BYTES, **OPTIONS)
    runner = llm.engine.worker.runner
    runner.capture_graphs(4, llm.engine.runtime.max_model_len)
    runner.capture_prefill_graphs(64)
    prompts = [random_prompt(n, seed=40 + n) for n in (3, 30, 70)]
    for prompt, out in zip(prompts, llm.generate(prompts, greedy()), strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, NEW_TOKENS)
    assert runner.graphs.launches > 0 and runner.prefill_graphs.launches > 0


def test_speculative_verify_rows_give_hf_output(v3):
    """ngram speculation's verify steps (decode rows of one sequence attending up to their own
    positions), drafts accepted and rejected mid-run."""
    hf, folder = v3
    spec = dict(speculative_method="ngram", num_speculative_tokens=3)
    llm = LLM(folder, kv_cache_memory_bytes=KV_BYTES, **OPTIONS, **spec)
    prompts = [random_prompt(n, seed=60 + n) for n in (5, 20)]
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    reference = {tuple(p): e for p, e in zip(prompts, expected, strict=True)}
    llm.engine.core.proposer = OracleProposer(reference, wrong_every=3)
    assert [o.token_ids for o in llm.generate(prompts, greedy(12))] == expected
    totals = llm.engine.scheduler.spec_totals
    assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens


def test_fp8_latent_cache_run_completes(v3):
    _, folder = v3
    llm = LLM(folder, kv_cache_dtype="fp8", kv_cache_memory_bytes=KV_BYTES, **OPTIONS)
    outs = llm.generate([random_prompt(n, seed=n) for n in (9, 50)], greedy())
    assert [len(o.token_ids) for o in outs] == [NEW_TOKENS, NEW_TOKENS]
    pool = llm.engine.worker.kv_cache.pool
    assert pool.dtype == torch.float8_e4m3fn and pool.shape[1] == 1
    written = pool[:, 0, :-1].float()
    assert written.abs().sum() > 0 and torch.isfinite(written).all()


def test_tensor_parallel_2_equals_1(v3):
    """Heads split over two gloo ranks (q_b_proj and kv_b_proj by heads, o_proj by rows);
    q_a_proj and kv_a_proj_with_mqa whole on each, so each rank caches the whole latent."""
    hf, folder = v3
    prompts = [random_prompt(n, seed=80 + n) for n in (1, 17, 45)]
    with LLM(folder, tp=2, kv_cache_memory_bytes=KV_BYTES, **OPTIONS) as llm:
        assert llm.engine.worker.rank_spec.num_heads == 2
        got = [o.token_ids for o in llm.generate(prompts, greedy())]
    assert got == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("mode,graphs", [("decompressed", False), ("auto", False),
                                         ("decompressed", True)])  # fmt: skip
def test_decompressed_prefill_gives_hf_output_with_prefix_hits_and_chunks(
    v3, mode, graphs, monkeypatch
):
    """--mla-prefill decompressed: every prefill chunk attends over per-head K and V rebuilt
    from the cached latents. "auto" with a 16-token threshold: in the same steps long chunks
    run decompressed, short ones and decode rows absorbed. Prompts around block boundaries,
    then a prefix-cache hit whose 60 new tokens run as two chunks (40-token budget); `graphs`:
    through the piecewise prefill graphs' buffers (on CPU, run eagerly)."""
    monkeypatch.setattr(mla_prefill, "AUTO_DECOMPRESS", mla_prefill.DecompressRule(16, 1 << 20))
    calls = {"absorbed_sequence": 0, "decompressed_sequence": 0}
    for name in calls:  # count the torch backend's calls of each form, which still run
        form = getattr(torch_backend, name)

        def counted(*args, _form=form, _name=name):
            calls[_name] += 1
            return _form(*args)

        monkeypatch.setattr(torch_backend, name, counted)
    hf, folder = v3
    llm = LLM(folder, mla_prefill=mode, kv_cache_memory_bytes=KV_BYTES, **OPTIONS)
    assert llm.engine.worker.backend.mla_prefill == mode
    if graphs:
        llm.engine.worker.runner.capture_prefill_graphs(64)
    prompts = [random_prompt(n, seed=n) for n in (1, 17, 33, 100)]
    for prompt, out in zip(prompts, llm.generate(prompts, greedy()), strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, NEW_TOKENS), len(prompt)
    shared = random_prompt(48, seed=7)
    llm.generate(shared + random_prompt(5, seed=8), greedy())
    second = shared + random_prompt(60, seed=9)
    out = llm.generate(second, greedy())[0]
    assert out.num_cached_tokens >= 48
    assert out.token_ids == hf_greedy(hf, second, NEW_TOKENS)
    assert calls["decompressed_sequence"] > 0
    assert (calls["absorbed_sequence"] > 0) == (mode == "auto")
    assert (llm.engine.worker.runner.prefill_graphs is not None) == graphs
    if graphs:
        assert llm.engine.worker.runner.prefill_graphs.launches > 0


def test_draft_model_speculation_is_refused_for_latent_attention(v3):
    _, folder = v3
    with pytest.raises(ValueError, match="speculative_method=draft.*DeepseekV3ForCausalLM"):
        LLM(folder, speculative_method="draft", speculative_model=folder, **OPTIONS)


def test_flash_attn_refuses_latent_attention():
    with pytest.raises(ValueError, match="flash_attn.*latent attention"):
        choose_backend("flash_attn", torch.device("cuda"), 256, latent=True)


def test_rope_spec_reads_yarn_and_the_rotary_layout_as_transformers_does():
    config = CONFIGS["v3_lora_yarn"]()
    spec = ModelSpec.from_hf_config(config)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    assert torch.equal(rope_inv_freq(spec.rotary_dim, spec.rope), inv_freq)
    assert spec.rope.cos_sin_scale == pytest.approx(attention_factor) and attention_factor != 1
    assert spec.rope.interleaved
    config.rope_interleave = False  # V3 may rotate halves
    assert not ModelSpec.from_hf_config(config).rope.interleaved
    assert ModelSpec.from_hf_config(CONFIGS["v2_greedy"]()).rope.interleaved


def latent_case(seed: int = 0):
    """Random MLA inputs at the real latent widths: 2 sequences, the second with 5 cached
    tokens, in 4-token blocks."""
    g = torch.Generator().manual_seed(seed)
    heads, nope, rope, rank, v = 4, 16, 64, 512, 16

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    proj = LatentProjection(rnd(heads, nope, rank) / 8, rnd(heads, v, rank) / 8)
    cache = torch.zeros(8, 4, 1, rank + rope)
    tables = torch.tensor([[0, 1, 0], [2, 3, 4]], dtype=torch.int32)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, 6, 10], dtype=torch.int32),
        seq_lens=torch.tensor([6, 9], dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor([0, 1, 2, 3, 4, 5, 13, 14, 15, 16]),
        query_lens_cpu=[6, 4],
        seq_lens_cpu=[6, 9],
        max_query_len=6,
        max_seq_len=9,
    )
    cached = rnd(5, rank + rope)  # the second sequence's first 5 tokens, already written
    cache.view(-1, rank + rope)[8:13] = cached
    tokens = rnd(10, heads, nope), rnd(10, heads, rope), rnd(10, rank), rnd(10, rope)
    return proj, cache, metadata, tokens, cached


def decompressed_attention(proj, metadata, tokens, cached, scale):
    """HF's form: every head's key and value rebuilt from the latent rows, then causal
    softmax attention per sequence."""
    q_nope, q_pe, latent, k_pe = tokens
    rows = torch.cat((latent, k_pe), dim=-1)
    out = []
    for i, n in enumerate(metadata.query_lens_cpu):
        start = metadata.query_start_loc[i].item()
        context = rows[start : start + n]
        if i == 1:
            context = torch.cat((cached, context))
        c, kr = context[:, :512], context[:, 512:]
        keys = torch.einsum("hnl,sl->shn", proj.w_uk, c)
        values = torch.einsum("hvl,sl->shv", proj.w_uv, c)
        for j in range(n):
            pos = len(context) - n + j
            q_n, q_r = q_nope[start + j], q_pe[start + j]
            scores = (torch.einsum("hn,shn->hs", q_n, keys) + q_r @ kr.T) * scale
            probs = scores[:, : pos + 1].softmax(-1)
            out.append(torch.einsum("hs,shv->hv", probs, values[: pos + 1]))
    return torch.stack(out)


def on(device: str, value):
    """`value` (tensors, tuples, dataclasses of tensors) with every tensor on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(on(device, v) for v in value)
    if dataclasses.is_dataclass(value):
        fields = {f.name: on(device, getattr(value, f.name)) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **fields)
    return value


@pytest.mark.parametrize("mode", ["absorbed", "decompressed"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_latent_attention_in_either_prefill_form_equals_per_head_attention(backend, mode):
    """Prefill (a fresh sequence and one over cached latents) in the `mla_prefill` form, then
    each sequence's next token as a decode row (absorbed): against per-head keys and values.
    Triton runs on the GPU where there is one, in the interpreter elsewhere."""
    if backend == "triton":
        pytest.importorskip("triton")
        pytest.importorskip("common.model.kernels.mla_decode")
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    proj, cache, metadata, tokens, cached = latent_case()
    scale = 0.1
    attention = create_backend(backend, mode)
    args = on(device, (tokens, proj, cache, metadata))
    out = attention.latent_forward(*args[0][:2], *args[0][2:], *args[1:], scale).cpu()
    want = decompressed_attention(proj, metadata, tokens, cached, scale)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    # One more token per sequence, as decode rows at positions 6 and 9.
    g = torch.Generator().manual_seed(1)
    step = [torch.randn(2, *t.shape[1:], generator=g) for t in tokens]
    decode = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([7, 10], dtype=torch.int32),
        block_tables=metadata.block_tables,
        slot_mapping=torch.tensor([6, 17]),
        query_lens_cpu=[1, 1],
        seq_lens_cpu=[7, 10],
        max_query_len=1,
        max_seq_len=10,
    )
    args = on(device, (tuple(step), proj, args[2], decode))
    out = attention.latent_forward(*args[0][:2], *args[0][2:], *args[1:], scale).cpu()
    both = [torch.cat((a[:6], b[:1], a[6:], b[1:])) for a, b in zip(tokens, step, strict=True)]
    full = AttentionMetadata(
        query_start_loc=torch.tensor([0, 7, 12], dtype=torch.int32),
        seq_lens=torch.tensor([7, 10], dtype=torch.int32),
        block_tables=metadata.block_tables,
        slot_mapping=torch.zeros(12, dtype=torch.int64),
        query_lens_cpu=[7, 5],
        seq_lens_cpu=[7, 10],
        max_query_len=7,
        max_seq_len=10,
    )
    want = decompressed_attention(proj, full, both, cached, scale)
    torch.testing.assert_close(out, want[[6, 11]], rtol=1e-4, atol=1e-4)
