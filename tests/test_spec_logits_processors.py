"""Grammar masks and logit_bias on the drafted rows of a speculative verify step
(`LogitsProcessors.apply_drafts`), with real xgrammar and the embedded tokenizer: every drafted
row is masked as `apply` masks a sequence whose output already holds that row's prefix."""

from __future__ import annotations

import json

import pytest
import torch

from common.engine.logits_processors import LogitsProcessors
from common.engine.sequence import Sequence
from common.protocol.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
STRUCTURED = {"type": "json_schema", "schema": json.dumps(SCHEMA)}
TEXT = '{"name": "Ada Lovelace", "age": 36}'  # the grammar's separators; no free whitespace


@pytest.fixture(scope="module")
def tokenizer():
    from common.model.source import resolve_model
    from common.text.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None).directory)


@pytest.fixture(scope="module")
def eos(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.fixture(scope="module")
def text_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) >= 8
    return ids


def processors(tokenizer, eos: int) -> LogitsProcessors:
    return LogitsProcessors(lambda: tokenizer, len(tokenizer), [eos])


def grammar_seq(rid: str, output: list[int], **params) -> Sequence:
    return Sequence(
        rid, [1, 2], SamplingParams(structured=STRUCTURED, **params), output_token_ids=output
    )


def expected_rows(
    reference: LogitsProcessors, seq: Sequence, drafts: list[int], raw: torch.Tensor
) -> torch.Tensor:
    """What `apply` gives each row, one fresh sequence per prefix output + drafts[:j]."""
    rows = []
    for j in range(len(drafts) + 1):
        prefix = Sequence(
            f"{seq.request_id}/{j}",
            seq.prompt_token_ids,
            seq.params,
            output_token_ids=seq.output_token_ids + drafts[:j],
        )
        rows.append(reference.apply(raw[j : j + 1].clone(), [prefix]))
    return torch.cat(rows)


def test_each_drafted_row_is_masked_as_if_its_prefix_were_accepted(tokenizer, eos, text_ids):
    lp, reference = processors(tokenizer, eos), processors(tokenizer, eos)
    vocab = len(tokenizer)
    a = grammar_seq("a", text_ids[:2])
    b = grammar_seq("b", text_ids[:5])
    plain = Sequence("p", [1, 2], SamplingParams())
    drafts = [text_ids[2:6], [], text_ids[5:7]]
    raw = torch.randn(5 + 1 + 3, vocab, generator=torch.Generator().manual_seed(0))
    out = lp.apply_drafts(raw.clone(), [a, plain, b], drafts)
    assert torch.equal(out[0:5], expected_rows(reference, a, drafts[0], raw[0:5]))
    assert torch.equal(out[5], raw[5])  # the neighbour's masks do not leak into its row
    assert torch.equal(out[6:9], expected_rows(reference, b, drafts[2], raw[6:9]))
    for row in range(9):  # every grammar row is really constrained, and differently
        if row != 5:
            assert 0 < int(torch.isfinite(out[row]).sum()) < vocab
    assert not torch.equal(torch.isinf(out[0]), torch.isinf(out[1]))


def test_the_matcher_is_rolled_back_to_its_caught_up_state(tokenizer, eos, text_ids):
    lp, reference = processors(tokenizer, eos), processors(tokenizer, eos)
    seq = grammar_seq("r", text_ids[:3])
    raw = torch.randn(4, len(tokenizer), generator=torch.Generator().manual_seed(1))
    drafted = lp.apply_drafts(raw.clone(), [seq], [text_ids[3:6]])
    assert torch.equal(lp.apply(raw[:1].clone(), [seq]), drafted[:1])
    # The verifier accepted two drafts and sampled a third token: the next step's mask is
    # the one after those tokens, not after the drafts the matcher was walked over.
    seq.output_token_ids += text_ids[3:6]
    again = lp.apply_drafts(raw[:2].clone(), [seq], [text_ids[6:7]])
    assert torch.equal(again, expected_rows(reference, seq, text_ids[6:7], raw[:2]))


def test_rows_after_a_draft_the_grammar_refuses_stay_unmasked(tokenizer, eos, text_ids):
    lp, reference = processors(tokenizer, eos), processors(tokenizer, eos)
    seq = grammar_seq("r", text_ids[:2])
    raw = torch.randn(4, len(tokenizer), generator=torch.Generator().manual_seed(2))
    bad = tokenizer.encode("}}", add_special_tokens=False)[0]
    drafts = [text_ids[2], bad, text_ids[3]]
    out = lp.apply_drafts(raw.clone(), [seq], [drafts])
    assert torch.isinf(out[1, bad])  # the row that scores the bad draft masks it out
    assert torch.equal(out[2:], raw[2:])  # never reached by the verifier: left unmasked
    assert torch.equal(out, expected_rows(reference, seq, drafts, raw))
    # The refused draft did not unconstrain the request: its matcher is where it was.
    seq.output_token_ids.append(text_ids[2])
    next_rows = lp.apply_drafts(raw[:2].clone(), [seq], [[text_ids[3]]])
    assert torch.equal(next_rows, expected_rows(reference, seq, [text_ids[3]], raw[:2]))
    assert torch.isinf(next_rows).any()


def test_a_grammar_ended_mid_drafts_allows_only_stop_then_leaves_rows_unmasked(
    tokenizer, eos, text_ids
):
    lp, reference = processors(tokenizer, eos), processors(tokenizer, eos)
    seq = grammar_seq("r", text_ids[:-2], ignore_eos=True)
    drafts = text_ids[-2:] + [eos, text_ids[0]]
    raw = torch.randn(5, len(tokenizer), generator=torch.Generator().manual_seed(3))
    out = lp.apply_drafts(raw.clone(), [seq], [drafts])
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [eos]
    assert torch.equal(out[3:], raw[3:])  # terminated: unmasked, as `apply` leaves it
    assert torch.equal(out, expected_rows(reference, seq, drafts, raw))
    again = lp.apply(raw[:1].clone(), [seq])  # the stop token was rolled back too
    assert torch.equal(again, out[:1])


def test_logit_bias_is_added_on_every_row_of_a_biased_sequence(tokenizer, eos, text_ids):
    lp = processors(tokenizer, eos)
    vocab = len(tokenizer)
    biased = Sequence("b", [1], SamplingParams(logit_bias=[(7, 5.0), (9, -3.0)]))
    plain = Sequence("p", [1], SamplingParams())
    both = grammar_seq("g", text_ids[:2], logit_bias={text_ids[2]: 2.0})
    raw = torch.randn(3 + 2 + 2, vocab, generator=torch.Generator().manual_seed(4))
    out = lp.apply_drafts(raw.clone(), [biased, plain, both], [[7, 7], [3], text_ids[2:3]])
    bias = torch.zeros(vocab)
    bias[7], bias[9] = 5.0, -3.0
    assert torch.allclose(out[0:3], raw[0:3] + bias)
    assert torch.equal(out[3:5], raw[3:5])
    assert torch.isclose(out[5, text_ids[2]], raw[5, text_ids[2]] + 2.0)  # allowed, biased
    assert torch.isinf(out[5:7]).any(dim=1).all()  # and masked by its grammar
    reference = processors(tokenizer, eos)
    assert torch.equal(out[5:7], expected_rows(reference, both, text_ids[2:3], raw[5:7]))


def test_drafts_that_do_not_match_the_logit_rows_are_refused(tokenizer, eos):
    lp = processors(tokenizer, eos)
    seq = Sequence("r", [1], SamplingParams())
    with pytest.raises(ValueError, match="logits have 2 rows, drafts need 3"):
        lp.apply_drafts(torch.zeros(2, 8), [seq], [[1, 2]])
    with pytest.raises(ValueError, match="1 draft lists for 2 sequences"):
        lp.apply_drafts(torch.zeros(2, 8), [seq, seq], [[]])
