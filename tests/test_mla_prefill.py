"""MLA prefill's two forms (`common.model.attention.mla_prefill`): which sequences of a step
run decompressed, both forms in one step against per-head attention, FP8 caches, the
`mla_prefill` option. Triton runs on the GPU where there is one, in the interpreter elsewhere.
(Both forms against HF greedy output: tests/test_deepseek_matches_hf.py.)"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before any Triton kernel is imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from common.engine.config import MLA_PREFILL_MODES, EngineConfig, add_dataclass_args  # noqa: E402
from common.model.attention import base, create_backend, mla_prefill  # noqa: E402
from common.model.attention.base import AttentionMetadata  # noqa: E402
from common.model.attention.mla_prefill import (  # noqa: E402
    DecompressRule,
    decompressed_sequences,
)
from tests.test_deepseek_matches_hf import decompressed_attention, latent_case, on  # noqa: E402

BACKENDS = ["torch", "triton"]


def device_of(backend: str) -> str:
    if backend == "triton":
        pytest.importorskip("triton")
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def metadata(query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    starts = [sum(query_lens[:i]) for i in range(len(query_lens) + 1)]
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.zeros(len(seq_lens), 1, dtype=torch.int32),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def test_auto_decompresses_long_chunks_whose_context_fits_the_bound():
    md = metadata([300, 1, 256, 255, 400], [300, 5000, 4352, 255, 70000])
    rule = DecompressRule(min_query_tokens=256, max_context_rows=16 * 65536)
    assert decompressed_sequences("auto", md, 16, rule) == [0, 2]  # 400 new, but 70k context
    assert decompressed_sequences("auto", md, 8, rule) == [0, 2, 4]  # half the heads: it fits
    assert decompressed_sequences("absorbed", md, 16) == []
    assert decompressed_sequences("decompressed", md, 16) == [0, 1, 2, 3, 4]


def padded_case():
    """`latent_case` plus two padding tokens after its two sequences, written to the padding
    block (the pool's last)."""
    proj, cache, md, tokens, cached = latent_case()
    g = torch.Generator().manual_seed(2)
    tokens = tuple(torch.cat((t, torch.randn(2, *t.shape[1:], generator=g))) for t in tokens)
    padding_slot = (cache.shape[0] - 1) * cache.shape[1]
    slots = torch.cat((md.slot_mapping, torch.full((2,), padding_slot)))
    return proj, cache, dataclasses.replace(md, slot_mapping=slots), tokens, cached


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "rule,decompressed",
    [
        (DecompressRule(min_query_tokens=5, max_context_rows=1000), [0]),  # 6 new tokens, not 4
        (DecompressRule(min_query_tokens=1, max_context_rows=30), [0]),  # 4 heads x 9 > 30
        (DecompressRule(min_query_tokens=1, max_context_rows=36), [0, 1]),
    ],
)
def test_a_step_runs_each_sequence_in_its_form_and_zeroes_padding_rows(
    backend, rule, decompressed, monkeypatch
):
    """Under "auto" a step with both forms (the absorbed sequences as a compact batch on
    triton) equals per-head attention; padding rows come back zero."""
    monkeypatch.setattr(mla_prefill, "AUTO_DECOMPRESS", rule)
    proj, cache, md, tokens, cached = padded_case()
    scale, device = 0.1, device_of(backend)
    attention = create_backend(backend, "auto")
    args = on(device, (tokens, proj, cache, md))
    out = attention.latent_forward(*args[0], *args[1:], scale).cpu()
    assert decompressed_sequences("auto", md, 4) == decompressed
    unpadded = dataclasses.replace(md, slot_mapping=md.slot_mapping[:10])
    want = decompressed_attention(proj, unpadded, [t[:10] for t in tokens], cached, scale)
    torch.testing.assert_close(out[:10], want, rtol=1e-4, atol=1e-4)
    assert torch.equal(out[10:], torch.zeros_like(out[10:]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_cache_prefill_is_the_same_in_both_forms(backend):
    """Both forms read an FP8 cache as stored * kv_scale."""
    proj, cache, md, tokens, _ = latent_case()
    scale, kv_scale, device = 0.1, 0.05, device_of(backend)
    fp8 = torch.zeros(cache.shape, dtype=torch.float8_e4m3fn)
    create_backend("torch").write_latent(
        cache.flatten(0, 1)[8:13, 0, :512], cache.flatten(0, 1)[8:13, 0, 512:], fp8,
        torch.arange(8, 13), kv_scale,
    )  # fmt: skip
    outs = {}
    for mode in ("absorbed", "decompressed"):
        args = on(device, (tokens, proj, fp8.clone(), md))
        attention = create_backend(backend, mode)
        outs[mode] = attention.latent_forward(*args[0], *args[1:], scale, kv_scale).cpu()
    assert outs["absorbed"].abs().max() > 0.1
    torch.testing.assert_close(outs["decompressed"], outs["absorbed"], rtol=1e-4, atol=1e-4)


def test_mla_prefill_option_is_a_flag_and_refuses_unknown_values():
    assert MLA_PREFILL_MODES == base.MLA_PREFILL_MODES
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, EngineConfig)
    args = parser.parse_args(["--mla-prefill", "decompressed"])
    assert EngineConfig.from_options(mla_prefill=args.mla_prefill).mla_prefill == "decompressed"
    assert EngineConfig().mla_prefill == "auto"
    with pytest.raises(ValueError, match="mla_prefill must be one of.*'faster'"):
        EngineConfig.from_options(mla_prefill="faster")
    with pytest.raises(ValueError, match="mla_prefill must be one of.*'faster'"):
        create_backend("triton", "faster")
    assert create_backend("torch", "decompressed").mla_prefill == "decompressed"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_gpu_bf16_forms_agree_at_deepseek_v2_lite_widths_after_a_long_prefix():
    """16 heads, Dn = Dv = 128: a 300-token chunk after 4000 cached tokens (decompressed under
    "auto") and a decode row (absorbed) in one step, against the fp32 torch reference."""
    g = torch.Generator(device="cuda").manual_seed(0)
    heads, dn, dr, dc, dv, page = 16, 128, 64, 512, 128, 64

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device="cuda") * scale

    query_lens, seq_lens = [300, 1], [4300, 2000]
    pages = [-(-n // page) for n in seq_lens]
    cache = rnd(sum(pages) + 1, page, 1, dc + dr).bfloat16()
    tables = torch.zeros(2, max(pages), dtype=torch.int32, device="cuda")
    tables[0, : pages[0]] = torch.arange(pages[0])
    tables[1, : pages[1]] = torch.arange(pages[0], sum(pages))
    md = on("cuda", metadata(query_lens, seq_lens))
    md = dataclasses.replace(md, block_tables=tables)
    proj = base.LatentProjection(rnd(heads, dn, dc, scale=dc**-0.5).bfloat16(),
                                 rnd(heads, dv, dc, scale=dc**-0.5).bfloat16())  # fmt: skip
    q_nope, q_pe = rnd(301, heads, dn).bfloat16(), rnd(301, heads, dr).bfloat16()
    scale = (dn + dr) ** -0.5
    f32 = base.LatentProjection(proj.w_uk.float(), proj.w_uv.float())
    ref = create_backend("torch", "absorbed").latent_prefill(
        q_nope.float(), q_pe.float(), f32, cache.float(), md, scale
    )
    for mode in ("absorbed", "decompressed", "auto"):
        out = create_backend("triton", mode).latent_prefill(q_nope, q_pe, proj, cache, md, scale)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_prefill_benchmark_smoke_run_times_and_checks_both_forms(tmp_path):
    out = tmp_path / "mla_prefill.json"
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "bench_mla_prefill.py"), "--smoke",
         "--out", str(out)],
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    cases = [(p, c) for c in (0, 24) for p in (16, 40)]
    for part in ("layer", "engine"):
        assert [(r["prompt"], r["prefix"]) for r in report[part]] == cases
        assert all(r["absorbed_ms"] > 0 and r["decompressed_ms"] > 0 for r in report[part])
    for r in report["layer"]:
        assert r["rel_err"] < 3e-2 and r["rebuild_ms"] > 0 and r["attn_padded_ms"] > 0
    # 40 new tokens after 24: 1780 pairs x 4 heads x (2 (512 + 64) + 2 x 512), plus W_UK and
    # W_UV (2 x 512 x (32 + 32) a token and head) for the 40 new tokens, or the 64 rebuilt.
    last = report["layer"][-1]
    assert last["absorbed_flops"] == 4 * (1780 * 2176 + 40 * 65536)
    assert last["decompressed_flops"] == 4 * (1780 * (2 * 96 + 2 * 32) + 64 * 65536)
    assert all(r["same_first_token"] for r in report["engine"])
