"""Grouped decode: a verify step's rows of one sequence read its KV once (`decode_groups`).

The grouped kernel must give every row what the plain kernel (one program per row) and an
fp32 reference give it. Without CUDA the kernels run in Triton's CPU interpreter
(TRITON_INTERPRET must be set before the kernels are decorated, hence before the imports).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from common.model.attention.base import AttentionMetadata  # noqa: E402
from common.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from common.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from common.model.kernels.paged_attention import (  # noqa: E402
    DecodeScratch,
    paged_decode_attention,
)
from common.model.quantization.fp8_ops import FP8, quantize  # noqa: E402

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
PAGE = 16
K_SCALE, V_SCALE = 0.02, 0.01
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# (first row's length, rows in the run): runs crossing page boundaries, runs that start at
# length 1, plain rows (runs of one) between them.
RUNS = [(14, 5), (47, 1), (30, 3), (1, 4), (100, 2), (16, 1), (63, 5)]


def make_runs(runs, heads, kv_heads, head_dim, dtype, kv_fp8=False, seed=0):
    """A paged cache of random context, one block table per run (repeated on its rows), the
    rows' lengths (growing by one within a run) and `decode_groups`."""
    gen = torch.Generator().manual_seed(seed)
    longest = [start + n - 1 for start, n in runs]
    num_blocks = sum(-(-s // PAGE) for s in longest) + 2
    shape = (num_blocks, PAGE, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    if kv_fp8:
        k_cache = quantize(k_cache, torch.tensor(K_SCALE))
        v_cache = quantize(v_cache, torch.tensor(V_SCALE))
    else:
        k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-s // PAGE) for s in longest)
    tables, seq_lens, groups = [], [], []
    for (start, n), s in zip(runs, longest, strict=True):
        table = [order.pop() for _ in range(-(-s // PAGE))]
        tables += [table + [0] * (width - len(table))] * n
        seq_lens += range(start, start + n)
        groups += [n] + [0] * (n - 1)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen).to(dtype)

    def tensor(values, dt):
        return torch.tensor(values, dtype=dt, device=DEVICE)

    md = AttentionMetadata(
        query_start_loc=tensor(range(len(seq_lens) + 1), torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        block_tables=tensor(tables, torch.int32),
        slot_mapping=tensor([-1] * len(seq_lens), torch.int64),
        query_lens_cpu=[1] * len(seq_lens),
        seq_lens_cpu=seq_lens,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        decode_groups=tensor(groups, torch.int32),
        decode_rows_max=max(n for _, n in runs),
    )
    return q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), md


def reference(q, k_cache, v_cache, md, scale, k_scale=1.0, v_scale=1.0):
    """fp32 attention of each row over `stored.float() * scale` of its first seq_len keys."""
    group = q.shape[1] // k_cache.shape[2]
    outs = []
    for i, s in enumerate(md.seq_lens_cpu):
        pos = torch.arange(s, device=q.device)
        slots = md.block_tables[i].long()[pos // PAGE] * PAGE + pos % PAGE
        keys = (k_cache.flatten(0, 1)[slots].float() * k_scale).repeat_interleave(group, 1)
        values = (v_cache.flatten(0, 1)[slots].float() * v_scale).repeat_interleave(group, 1)
        probs = (torch.einsum("hd,khd->hk", q[i].float(), keys) * scale).softmax(-1)
        outs.append(torch.einsum("hk,khd->hd", probs, values))
    return torch.stack(outs)


def decode(q, k_cache, v_cache, md, splits, grouped, scales=(1.0, 1.0)):
    """The kernel into NaN-filled output and scratch, so an unwritten row shows."""
    out = torch.full_like(q, float("nan"))
    scratch = None
    if splits > 1:
        scratch = DecodeScratch.allocate(q.shape[0], q.shape[1], splits, q.shape[2], q.device)
        for t in (scratch.max_log2, scratch.sum_exp, scratch.acc):
            t.fill_(float("nan"))
    paged_decode_attention(
        q, k_cache, v_cache, out, md.seq_lens, md.block_tables, q.shape[2] ** -0.5, scratch,
        16, k_scale=scales[0], v_scale=scales[1],
        groups=md.decode_groups if grouped else None, rows_max=md.decode_rows_max,
    )  # fmt: skip
    return out


# (heads, kv_heads, head_dim): GQA 4 (tile 32 rows at 5 rows a run), 3 (not a power of two),
# 7 (Qwen2.5-7B's ratio: a 64-row tile) and MHA.
CASES = [(8, 2, 64), (6, 2, 32), (7, 1, 32), (2, 2, 64)]


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("heads,kv_heads,head_dim", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_rows_equal_plain_rows_and_the_reference(splits, heads, kv_heads, head_dim, dtype):
    q, kc, vc, md = make_runs(RUNS, heads, kv_heads, head_dim, dtype)
    grouped = decode(q, kc, vc, md, splits, grouped=True)
    plain = decode(q, kc, vc, md, splits, grouped=False)
    scale = head_dim**-0.5
    torch.testing.assert_close(grouped.float(), plain.float(), **TOL[dtype])
    torch.testing.assert_close(grouped.float(), reference(q, kc, vc, md, scale), **TOL[dtype])


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_rows_on_an_fp8_cache_apply_the_scales(splits, dtype):
    q, kc, vc, md = make_runs(RUNS, 8, 2, 64, dtype, kv_fp8=True)
    assert kc.dtype == FP8
    scales = (K_SCALE, V_SCALE)
    grouped = decode(q, kc, vc, md, splits, grouped=True, scales=scales)
    plain = decode(q, kc, vc, md, splits, grouped=False, scales=scales)
    ref = reference(q, kc, vc, md, 0.125, *scales)
    torch.testing.assert_close(grouped.float(), plain.float(), **TOL[dtype])
    torch.testing.assert_close(grouped.float(), ref, **TOL[dtype])


def test_a_run_reads_its_first_rows_table_and_its_own_lengths_only():
    """The contract: a follower's table and a padding tail are not read. Garbage in the
    followers' tables and rows after the batch change nothing."""
    q, kc, vc, md = make_runs([(20, 3), (5, 1)], 4, 2, 64, torch.float32)
    expected = reference(q, kc, vc, md, 0.125)
    md.block_tables[1:3] = kc.shape[0] - 1  # another sequence's block
    out = decode(q, kc, vc, md, 4, grouped=True)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


def test_triton_backend_passes_the_groups_and_other_backends_ignore_them():
    q, kc, vc, md = make_runs(RUNS, 8, 2, 64, torch.float32)
    md.max_seq_len = 4096  # an upper bound, as under CUDA graphs: several splits
    ref = reference(q, kc, vc, md, 0.125)
    triton_out = TritonAttentionBackend().decode(q, kc, vc, md, 0.125)
    torch_out = TorchAttentionBackend().decode(q, kc, vc, md, 0.125)
    torch.testing.assert_close(triton_out, ref, **TOL[torch.float32])
    torch.testing.assert_close(torch_out, ref, **TOL[torch.float32])


def test_bad_groups_or_rows_max_are_refused_with_the_values():
    q, kc, vc, md = make_runs([(3, 2)], 4, 2, 64, torch.float32)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="rows_max must be >= 1, got 0"):
        paged_decode_attention(q, kc, vc, out, md.seq_lens, md.block_tables, 0.1, None,
                               groups=md.decode_groups, rows_max=0)  # fmt: skip
    with pytest.raises(ValueError, match="groups must be int32"):
        paged_decode_attention(q, kc, vc, out, md.seq_lens, md.block_tables, 0.1, None,
                               groups=md.decode_groups.long(), rows_max=2)  # fmt: skip


def test_tp_follower_receives_the_groups():
    from common.engine.model_runner import HostInputs
    from common.engine.tp_link import body_size, pack, unpack

    h = HostInputs(
        input_ids=[5, 6, 7, 8], positions=[9, 10, 11, 3], slots=[9, 10, 11, 35],
        query_lens=[1] * 4, seq_lens=[10, 11, 12, 4], block_tables=[[0]] * 3 + [[2]],
        row_keys=[("a", 0, 0, 1, j) for j in range(3)] + [("b", 0, 0, 1)],
        logits_indices=[0, 1, 2, 3], sample_rows=[0, 1], groups=[3, 0, 0, 1],
    )  # fmt: skip
    header, body = pack(h)
    assert body.numel() == body_size(header.tolist())
    got, _ = unpack(header.tolist(), body)
    assert got.groups == [3, 0, 0, 1]
    assert (got.seq_lens, got.block_tables, got.sample_rows) == (h.seq_lens, h.block_tables, [0, 1])


@pytest.mark.parametrize("graphs", [False, True])
def test_engine_verify_steps_on_the_triton_backend_give_the_plain_tokens(tmp_path, graphs):
    """Greedy speculation with drafts that are right except every third: verify runs of up to
    five rows go through the grouped kernel (eager metadata or the graphs' static groups)
    and the tokens are exactly those of plain decoding on the same backend."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from common import LLM, SamplingParams
    from tests.test_spec_decode_engine import VOCAB, OracleProposer, prompts
    from tests.tiny_models import TINY_SHAPE

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, **TINY_SHAPE, max_position_embeddings=256,
                         initializer_range=0.25, tie_word_embeddings=False)  # fmt: skip
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (9, 14)]
    chosen = prompts()[2:4]

    def engine(**options) -> LLM:
        # float32 on the GPU too: the comparison is exact only without bf16 near-ties.
        return LLM(str(tmp_path), device=DEVICE.type, dtype="float32", max_num_seqs=4,
                   attention_backend="triton", kv_cache_memory_bytes=8 << 20,
                   enforce_eager=not graphs, **options)  # fmt: skip

    plain = [o.token_ids for o in engine().generate(chosen, params)]
    llm = engine(speculative_method="ngram", num_speculative_tokens=4)
    worker = llm.engine.worker
    assert worker.decode_rows_max() == 5
    if graphs and DEVICE.type == "cpu":  # the graph code path, replayed eagerly
        rows, max_len = worker._decode_graph_rows(), llm.engine.runtime.max_model_len
        worker.runner.capture_graphs(rows, max_len, worker.decode_rows_max())
    reference = {tuple(p): out for p, out in zip(chosen, plain, strict=True)}
    llm.engine.core.proposer = OracleProposer(reference, wrong_every=3)
    assert [o.token_ids for o in llm.generate(chosen, params)] == plain
    assert llm.engine.scheduler.spec_totals.num_accepted_tokens > 0
    if graphs:
        assert worker.runner.graphs.launches > 0
