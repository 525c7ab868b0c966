"""The drafters' graph path (`capture_graphs`; on CPU the same static buffers, replayed
eagerly) drafts what the eager path drafts, across rejections, a preemption and catch-ups too
long for the graphs, and a propose reads the device once."""

from __future__ import annotations

import pytest
import torch

import tests.test_spec_draft_model as dm
import tests.test_spec_eagle3 as e3
from common.engine.config import SpeculativeConfig
from common.engine.spec_decode.eagle3 import Eagle3Proposer

K = dm.K
MAX_ROWS = 16  # a new prompt's catch-up does not fit: it runs eagerly


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory):
    target = dm.save_llama(tmp_path_factory.mktemp("target"), seed=0)
    draft = dm.save_llama(tmp_path_factory.mktemp("draft"), seed=5, layers=1)
    return target, draft


def draft_pair(draft_dirs):
    eager, graphs = dm.proposer(*draft_dirs), dm.proposer(*draft_dirs)
    graphs.capture_graphs(MAX_ROWS, 512)
    return eager, graphs


def two_sequences():
    return [
        dm.sequence("a", dm.prompt_of(21, seed=1), [5], range(0, 8)),
        dm.sequence("b", dm.prompt_of(7, seed=2), [6], range(8, 16)),
    ]


def batch_of(seqs):
    batch = dm.decode_item(seqs[0])
    for seq in seqs[1:]:
        batch.items.append(dm.decode_item(seq).items[0])
    return batch


def test_draft_model_graphs_draft_what_the_eager_path_drafts(draft_dirs):
    eager, graphs = draft_pair(draft_dirs)
    seqs = two_sequences()
    # Each verify step keeps `accepted` drafts, then a token of the target's that rejects the
    # next one; the limits differ per sequence (and one sequence sits a step out).
    for accepted, limits in ((2, [K, K - 1]), (4, [K, 2]), (0, [0, K]), (1, [K, K]), (3, [2, K])):
        batch = batch_of(seqs)
        want = eager.propose(batch, limits).token_ids
        assert graphs.propose(batch, limits).token_ids == want
        for seq, drafts in zip(seqs, want, strict=True):
            if drafts:
                keep = drafts[: min(accepted, len(drafts))]
                rejected = drafts[len(keep)] if len(keep) < len(drafts) else -1
                seq.output_token_ids += [*keep, 3 if rejected != 3 else 4]
    assert graphs.graphs.launches > 0
    # A preempted sequence starts over in new blocks: its catch-up is too long for the graphs.
    seqs[0].num_preemptions, seqs[0].block_ids = 1, list(range(16, 24))
    batch = batch_of(seqs)
    assert graphs.propose(batch, [K, K]).token_ids == eager.propose(batch, [K, K]).token_ids


def eagle_proposer(target_dir, head_dir, max_rows: int | None) -> Eagle3Proposer:
    target, _ = e3.load_target(target_dir)
    proposer = Eagle3Proposer.build(
        SpeculativeConfig("eagle3", K, str(head_dir)),
        target,
        num_blocks=32,
        block_size=e3.BLOCK,
        max_model_len=256,
        device=e3.CPU,
        dtype=torch.float32,
        backend=e3.create_backend("torch"),
    )
    if max_rows is not None:
        proposer.capture_graphs(max_rows, 256)
    return proposer


def test_eagle3_graphs_draft_what_the_eager_path_drafts(tmp_path):
    e3.write_head(tmp_path / "head")
    target_dir = dm.save_llama(tmp_path / "target", seed=0, layers=e3.TARGET_LAYERS)
    eager = eagle_proposer(target_dir, tmp_path / "head", None)
    graphs = eagle_proposer(target_dir, tmp_path / "head", 8)
    width = eager._like.shape[1]
    g = torch.Generator().manual_seed(0)
    seqs = [
        dm.sequence("a", dm.prompt_of(19, seed=4), [7], [5, 2, 9]),
        dm.sequence("b", dm.prompt_of(5, seed=6), [8], [0, 1]),
    ]

    def observe(starts: list[int], counts: list[int]) -> None:
        aux = torch.randn(sum(counts), width, generator=g)
        for proposer in (eager, graphs):
            proposer.observe([s.request_id for s in seqs], starts, counts, aux)

    observe([0, 0], [19, 5])
    for step, (accepted, limits) in enumerate(((2, [K, K - 1]), (0, [K, K]), (3, [K, 2]))):
        if step == 2:  # "a" preempted: new blocks, its head KV recomputed from position 0
            seqs[0].num_preemptions, seqs[0].block_ids = 1, [10, 11, 12]
        batch = batch_of(seqs)
        want = eager.propose(batch, limits).token_ids
        assert graphs.propose(batch, limits).token_ids == want
        starts = [s.num_tokens - 1 for s in seqs]
        observe(starts, [len(d) + 1 for d in want])
        for seq, drafts in zip(seqs, want, strict=True):
            seq.output_token_ids += [*drafts[:accepted], 3]
    assert graphs.graphs.launches > 0
    assert eager.num_unobserved_rows == graphs.num_unobserved_rows


SYNCS = ("tolist", "item", "cpu", "__bool__", "__int__", "__float__", "__index__")


def count_syncs(monkeypatch) -> list[str]:
    """Every read of a tensor's values by the host, named (on CPU no read blocks, but each
    of these would wait for the device on a GPU)."""
    calls: list[str] = []
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    return calls


def test_a_graph_propose_reads_the_device_once(draft_dirs, monkeypatch):
    _, graphs = draft_pair(draft_dirs)
    seqs = two_sequences()
    graphs.propose(batch_of(seqs), [K, K])  # the prompts' catch-up (eager)
    for seq in seqs:
        seq.output_token_ids += [3, 4]
    calls = count_syncs(monkeypatch)
    launches = graphs.graphs.launches
    drafts = graphs.propose(batch_of(seqs), [K, K - 1]).token_ids
    assert [len(d) for d in drafts] == [K, K - 1]
    assert graphs.graphs.launches == launches + K  # catch-up, then K - 1 draft steps
    assert calls == ["tolist"]
