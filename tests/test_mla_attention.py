"""MLA (absorbed form) paged attention kernels against the float32 torch reference, at the real
latent widths (Dc = 512, Dr = 64).

Without CUDA the Triton kernels run in the CPU interpreter (TRITON_INTERPRET must be set before
the kernels are decorated, hence before the imports below). Every cache slot outside a
sequence's context holds NaN, so a kernel that reads past a length or an unowned page fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from common.model.attention.mla_reference import (  # noqa: E402
    mla_reference,
    write_latent_reference,
)
from common.model.kernels.mla_attention import paged_mla_prefill, write_latent  # noqa: E402
from common.model.kernels.mla_decode import (  # noqa: E402
    FP32_DECODE_CONFIG,
    MLADecodeConfig,
    mla_decode_config,
    mla_decode_scratch,
    mla_decode_splits,
    paged_mla_decode,
)
from common.model.kernels.paged_attention import DecodeScratch  # noqa: E402
from common.model.quantization.fp8_ops import FP8  # noqa: E402

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
DC, DR = 512, 64
SCALE = 192**-0.5  # DeepSeek's 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)
KV_SCALE = 0.05
# fp32: the kernels and the reference differ only in summation order. bf16 (q, cache or P):
# the kernel rounds P to bf16 before P c; the reference stays in fp32.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@dataclass
class Batch:
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor

    def reference(self, kv_scale: float = 1.0, prefill: bool = True) -> torch.Tensor:
        qsl = self.query_start_loc if prefill else None
        return mla_reference(self.q_nope, self.q_pe, self.cache, self.seq_lens, self.block_tables,
                             SCALE, kv_scale, qsl)  # fmt: skip


def make_batch(q_lens, seq_lens, heads, dtype, cache_dtype=None, page=16, seed=0) -> Batch:
    """Contexts in shuffled pages of a NaN-filled pool (`write_latent_reference`); tables
    padded with the padding block (the last), which is also a length-0 row's whole table."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    pages = [-(-s // page) for s in seq_lens]
    num_blocks = sum(pages) + 3
    cache = torch.full((num_blocks + 1, page, 1, DC + DR), float("nan")).to(DEVICE, cache_dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(n)] for n in pages]
    slots = [
        t[p // page] * page + p % page
        for t, s in zip(tables, seq_lens, strict=True)
        for p in range(s)
    ]
    n = len(slots)
    latent, k_pe = torch.randn(n, DC, generator=gen), torch.randn(n, DR, generator=gen)
    slot_t = torch.tensor(slots, dtype=torch.int64)
    write_latent_reference(latent.to(DEVICE), k_pe.to(DEVICE), cache, slot_t.to(DEVICE), KV_SCALE)
    width = max(pages) + 1
    table_t = torch.tensor([t + [num_blocks] * (width - len(t)) for t in tables], dtype=torch.int32)
    t = sum(q_lens)
    return Batch(
        q_nope=torch.randn(t, heads, DC, generator=gen).to(DEVICE, dtype),
        q_pe=torch.randn(t, heads, DR, generator=gen).to(DEVICE, dtype),
        cache=cache,
        block_tables=table_t.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor([0, *q_lens], device=DEVICE).cumsum(0).to(torch.int32),
    )


# 16-key tiles, so short contexts span several tiles and splits.
SMALL_TILES = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=2)


def decode(b: Batch, splits: int | None, kv_scale: float = 1.0, config=SMALL_TILES):
    rows, heads = b.q_nope.shape[:2]
    scratch = None if splits is None else DecodeScratch.allocate(rows, heads, splits, DC, DEVICE)
    return paged_mla_decode(b.q_nope, b.q_pe, b.cache, b.block_tables, b.seq_lens, SCALE,
                            kv_scale, scratch=scratch, config=config)  # fmt: skip


# A one-key row, whole and partial key tiles over splits (64: most of them empty, the reduce in
# 64-column slices), a length-0 padding row on the padding block; 20 heads fill one head group
# and part of a second.
@pytest.mark.parametrize("splits", [1, 4, 64])
def test_decode_fp32_matches_reference_across_splits_and_a_padding_row(splits):
    b = make_batch([1] * 4, [1, 37, 130, 0], 20, torch.float32)
    out = decode(b, splits)
    torch.testing.assert_close(out, b.reference(prefill=False), **TOL[torch.float32])
    assert torch.equal(out[3], torch.zeros_like(out[3]))


# Each head tile: 40 heads are two groups of 32 (the second partial) or one padded group of 64
# or 128; out_split 2 splits the latent columns between two programs per group.
@pytest.mark.parametrize(
    "config",
    [
        MLADecodeConfig(32, 16, 8, 2),
        MLADecodeConfig(64, 16, 8, 2),
        MLADecodeConfig(64, 16, 4, 2, out_split=2),
        MLADecodeConfig(128, 16, 8, 2, out_split=2),
    ],
    ids=lambda c: f"h{c.block_h}o{c.out_split}",
)
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_head_tiles_and_column_split_match_reference(config, splits):
    if config.block_h == 128 and torch.cuda.is_available():
        # float32 tiles of 128 heads need 340 KB of shared memory, Hopper has 227 KB; the
        # bf16 GPU test below runs this config
        pytest.skip("float32 128-head tiles exceed the GPU's shared memory")
    b = make_batch([1] * 3, [1, 37, 0], 40, torch.float32)
    out = decode(b, splits, config=config)
    torch.testing.assert_close(out, b.reference(prefill=False), **TOL[torch.float32])
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_decode_config_holds_a_ranks_heads_in_one_program_up_to_64():
    block_h = {h: mla_decode_config(h).block_h for h in (8, 16, 20, 32, 64, 128)}
    assert block_h == {8: 16, 16: 16, 20: 32, 32: 32, 64: 64, 128: 64}
    assert mla_decode_config(128, FP8).block_h == 64
    assert mla_decode_config(128, torch.float32) == FP32_DECODE_CONFIG


def test_split_rule_fills_two_waves_and_keeps_64_keys_a_split():
    cpu = torch.device("cpu")  # counts as 132 SMs
    # One sequence: as many splits as 64 keys allow, up to 64.
    assert [mla_decode_splits(1, 16, cpu, n) for n in (40, 1024, 8192)] == [1, 16, 64]
    # 128 heads are 2 programs a split: 32 sequences make 64, so 4 splits (2 waves of 132 SMs).
    assert mla_decode_splits(32, 128, cpu, 8192) == 4
    assert mla_decode_splits(128, 16, cpu, 8192) == 2
    out_split = MLADecodeConfig(128, 16, 8, 2, out_split=2)
    assert mla_decode_splits(32, 128, cpu, 8192, config=out_split) == 4
    assert mla_decode_splits(512, 128, cpu) == 1


def test_decode_bf16_with_its_own_scratch_matches_reference():
    """The default split count (2 waves of 132 SMs off the device: most splits are empty)."""
    b = make_batch([1] * 3, [70, 5, 200], 16, torch.bfloat16)
    out = decode(b, None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float(), b.reference(prefill=False).float(), **TOL[torch.bfloat16]
    )


# A decode-like row over a prefix, a whole prompt over several query tiles and the causal
# diagonal, a chunk after a cached prefix, a short prompt.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_matches_reference_with_cached_prefixes(dtype):
    q_lens, seq_lens = [1, 19, 6, 3], [17, 19, 45, 3]
    b = make_batch(q_lens, seq_lens, 16, dtype)
    out = paged_mla_prefill(b.q_nope, b.q_pe, b.cache, b.query_start_loc, b.seq_lens,
                            b.block_tables, max(q_lens), SCALE, block_n=16)  # fmt: skip
    torch.testing.assert_close(out.float(), b.reference().float(), **TOL[dtype])


def test_chunked_prefill_equals_the_whole_prompt_at_once():
    whole = make_batch([40], [40], 8, torch.float32, page=8)
    once = paged_mla_prefill(whole.q_nope, whole.q_pe, whole.cache, whole.query_start_loc,
                             whole.seq_lens, whole.block_tables, 40, SCALE, block_n=16)  # fmt: skip
    chunks = []
    for start, end in ((0, 16), (16, 35), (35, 40)):
        lens = torch.tensor([end], dtype=torch.int32, device=DEVICE)
        qsl = torch.tensor([0, end - start], dtype=torch.int32, device=DEVICE)
        chunks.append(paged_mla_prefill(whole.q_nope[start:end], whole.q_pe[start:end],
                                        whole.cache, qsl, lens, whole.block_tables, end - start,
                                        SCALE, block_n=16))  # fmt: skip
    torch.testing.assert_close(torch.cat(chunks), once, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(once, whole.reference(), **TOL[torch.float32])


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_decode_and_prefill_match_the_dequantized_reference(q_dtype):
    b = make_batch([1, 12], [33, 50], 16, q_dtype, cache_dtype=FP8)
    out = paged_mla_prefill(b.q_nope, b.q_pe, b.cache, b.query_start_loc, b.seq_lens,
                            b.block_tables, 12, SCALE, KV_SCALE, block_n=16)  # fmt: skip
    torch.testing.assert_close(out.float(), b.reference(KV_SCALE).float(), **TOL[q_dtype])
    rows = b.query_start_loc[1:] - 1  # each sequence's last token as a decode row
    d = Batch(b.q_nope[rows], b.q_pe[rows], b.cache, b.block_tables, b.seq_lens, b.query_start_loc)
    ref = d.reference(KV_SCALE, False).float()
    for config in (SMALL_TILES, MLADecodeConfig(64, 16, 4, 2, out_split=2)):
        out = decode(d, 2, KV_SCALE, config)
        torch.testing.assert_close(out.float(), ref, **TOL[q_dtype])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_write_latent_equals_the_reference_writer_and_skips_negative_slots(cache_dtype):
    gen = torch.Generator().manual_seed(1)
    # 30x a unit normal past kv_scale: FP8 values beyond 448 saturate.
    latent = (torch.randn(9, DC, generator=gen) * 30).to(DEVICE, torch.bfloat16)
    k_pe = (torch.randn(9, DR, generator=gen) * 30).to(DEVICE, torch.bfloat16)
    slots = torch.randperm(4 * 8, generator=gen)[:9].to(DEVICE)
    slots[4] = -1
    kernel = torch.zeros(5, 8, 1, DC + DR, device=DEVICE).to(cache_dtype)
    ref = kernel.clone()
    write_latent(latent, k_pe, kernel, slots, KV_SCALE)
    write_latent_reference(latent, k_pe, ref, slots, KV_SCALE)
    as_bytes = lambda t: t.view(torch.uint8)  # noqa: E731
    assert torch.equal(as_bytes(kernel[:4]), as_bytes(ref[:4]))
    assert not as_bytes(kernel[4]).any()  # the slot -1 row went nowhere
    assert kernel.float().isfinite().all()


def test_misuse_raises_value_errors_naming_the_values():
    q_nope = torch.zeros(1, 16, DC, device=DEVICE)
    q_pe = torch.zeros(1, 16, DR, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    narrow = torch.zeros(2, 8, 1, DC, device=DEVICE)
    with pytest.raises(ValueError, match=r"512 \+ 64.*\(2, 8, 1, 512\)"):
        paged_mla_decode(q_nope, q_pe, narrow, table, lens, SCALE)
    fp8 = torch.zeros(2, 8, 1, DC + DR, device=DEVICE).to(FP8)
    with pytest.raises(ValueError, match="kv_scale, got 0.0"):
        paged_mla_decode(q_nope, q_pe, fp8, table, lens, SCALE, kv_scale=0.0)
    with pytest.raises(ValueError, match="Dc=384"):
        write_latent(torch.zeros(1, 384), torch.zeros(1, DR), torch.zeros(2, 8, 1, 448), lens)
    cache = torch.zeros(2, 8, 1, DC + DR, device=DEVICE)
    for bad in (MLADecodeConfig(24, 16, 4, 2), MLADecodeConfig(16, 16, 4, 2, out_split=4)):
        with pytest.raises(ValueError, match=rf"block_h={bad.block_h}.*out_split={bad.out_split}"):
            paged_mla_decode(q_nope, q_pe, cache, table, lens, SCALE, config=bad)


def test_decode_benchmark_smoke_run_reports_checked_times_floors_and_a_config_sweep(tmp_path):
    out = tmp_path / "mla.json"
    root = Path(__file__).resolve().parent.parent
    bench = root / "benchmarks" / "bench_mla_decode.py"
    proc = subprocess.run(
        [sys.executable, str(bench), "--smoke", "--sweep-configs", "--out", str(out)],
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [(r["heads"], r["batch"]) for r in results] == [(16, 1), (16, 2)]
    assert all(r["us_per_call"] > 0 and r["floor_us"] > 0 and r["max_err"] < 2e-2 for r in results)
    # Two smoke configs (out_split 1 and 2) at the rule's splits (1 for 40 keys) and twice it.
    for r in results:
        swept = [(e["config"], e["splits"], e["rule"]) for e in r["configs"]]
        assert swept == [
            (c, s, s == 1) for c in ("16/16/w4/s2/o1", "16/16/w4/s2/o2") for s in (1, 2)
        ]
        assert all(e["us"] > 0 and e["max_err"] < 2e-2 for e in r["configs"])
    best = proc.stdout.splitlines()[-2:]  # one line per row after the JSON
    assert all(
        line.split()[:3] == ["16", str(batch), "40"]
        for line, batch in zip(best, (1, 2), strict=True)
    )


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# The table's tiles (16 heads: one group of 16; 128: two of 64) and 128 heads in one program
# over two column halves, compiled for the GPU.
@needs_cuda
@pytest.mark.parametrize(
    "heads,config", [(16, None), (128, None), (128, MLADecodeConfig(128, 16, 8, 2, out_split=2))]
)
def test_gpu_bf16_decode_at_8k_context_matches_reference(heads, config):
    b = make_batch([1] * 3, [8192, 8191, 3000], heads, torch.bfloat16, page=64)
    ref = b.reference(prefill=False).float()
    scratch = mla_decode_scratch(3, heads, DC, DEVICE, max_seq_len=8192, config=config)
    for one in (None, scratch, DecodeScratch.allocate(3, heads, 1, DC, DEVICE)):
        out = paged_mla_decode(b.q_nope, b.q_pe, b.cache, b.block_tables, b.seq_lens, SCALE,
                               scratch=one, config=config)  # fmt: skip
        torch.testing.assert_close(out.float(), ref, **TOL[torch.bfloat16])


@needs_cuda
def test_gpu_bf16_prefill_chunk_after_a_long_prefix_matches_reference():
    b = make_batch([300, 1], [8192, 4000], 16, torch.bfloat16, page=64)
    out = paged_mla_prefill(b.q_nope, b.q_pe, b.cache, b.query_start_loc, b.seq_lens,
                            b.block_tables, 300, SCALE)  # fmt: skip
    torch.testing.assert_close(out.float(), b.reference().float(), **TOL[torch.bfloat16])
