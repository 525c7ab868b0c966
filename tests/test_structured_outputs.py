"""Structured outputs and logit_bias in the engine (xgrammar masks applied on the device
before sampling), on a tiny random model: whatever the weights, the output follows the schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from common import LLM, SamplingParams
from common.engine.logits_processors import LogitsProcessors
from common.engine.sequence import Sequence
from common.protocol.structured import check_structured
from tests.tiny_models import save_tiny_tool_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"enum": [3, 4]}},
            "required": ["kind"],
        },
    },
    "required": ["name", "age", "tags", "pet"],
}
STRUCTURED = {"type": "json_schema", "schema": json.dumps(SCHEMA)}


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    directory = save_tiny_tool_model(tmp_path_factory.mktemp("tiny") / "model")
    return LLM(str(directory), device="cpu")


def test_json_schema_outputs_validate_whatever_the_model_samples(tiny_llm):
    params = [
        SamplingParams(temperature=0.9, seed=s, max_tokens=200, structured=STRUCTURED)
        for s in range(6)
    ]
    for out in tiny_llm.generate([[1, 2, 3, 4]] * len(params), params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_object_output_is_one_json_object(tiny_llm):
    params = SamplingParams(
        temperature=0, max_tokens=64, structured={"type": "json_object"}, ignore_eos=False
    )
    out = tiny_llm.generate([5, 6, 7], params)[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # cut by max_tokens: still the start of an object
        assert out.text.startswith("{")


def test_constrained_and_unconstrained_requests_batched_in_one_step(tiny_llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = tiny_llm.generate([9, 8, 7], plain)[0].token_ids
    constrained = SamplingParams(temperature=0, max_tokens=200, structured=STRUCTURED)
    together = tiny_llm.generate([[9, 8, 7], [1, 2]], [plain, constrained])
    assert together[0].token_ids == alone  # its neighbour's mask does not leak into its row
    jsonschema.validate(json.loads(together[1].text), SCHEMA)


def test_the_race_never_draws_a_masked_token_even_when_its_noise_is_the_largest():
    """Row key 3548420002 hashes token 15484 to the top 24-bit value, whose uniform rounded to
    1.0 in float32: q = 0 and the masked token won the race as 0 / 0 (seen as a grammar
    violation at temperature 0.9)."""
    from common.engine import sampling_ops as ops

    salts = ops.token_salts(49152, "cpu")
    keys = torch.tensor([3548420002])
    assert float(ops.exponential_noise(keys, salts)[0, 15484]) > 0
    logits = torch.full((1, 49152), float("-inf"))
    logits[0, [109, 17859]] = torch.tensor([0.14, -0.25])
    assert int(ops.race(logits, keys, salts)[0]) in (109, 17859)


def test_a_matcher_resumed_from_the_tokens_so_far_masks_like_the_original(tiny_llm):
    """The decode node's case: the prefill node sampled the first tokens under the grammar."""
    tokenizer, spec = tiny_llm.tokenizer, tiny_llm.engine.worker.spec
    first = LogitsProcessors(lambda: tokenizer, spec.vocab_size, spec.eos_token_ids)
    seq = Sequence("r", [1, 2], SamplingParams(structured=STRUCTURED))
    generator = torch.Generator().manual_seed(0)
    for _ in range(6):
        logits = first.apply(torch.randn(1, spec.vocab_size, generator=generator), [seq])
        seq.output_token_ids.append(int(logits.argmax()))
    resumed = LogitsProcessors(lambda: tokenizer, spec.vocab_size, spec.eos_token_ids)
    copy = Sequence("r", [1, 2], seq.params, output_token_ids=list(seq.output_token_ids))
    raw = torch.randn(1, spec.vocab_size, generator=generator)
    expected = torch.isinf(first.apply(raw.clone(), [seq]))
    assert torch.equal(torch.isinf(resumed.apply(raw.clone(), [copy])), expected)
    assert 0 < int((~expected).sum()) < spec.vocab_size


def test_logit_bias_removes_or_forces_a_token(tiny_llm):
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    top = tiny_llm.generate([3, 4, 5], greedy)[0].token_ids[0]
    banned = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logit_bias={top: -100.0})
    assert tiny_llm.generate([3, 4, 5], banned)[0].token_ids[0] != top
    forced = SamplingParams(
        temperature=1.0, seed=1, max_tokens=4, ignore_eos=True, logit_bias=[(42, 100.0)]
    )
    assert tiny_llm.generate([3, 4, 5], forced)[0].token_ids == [42] * 4


def test_a_schema_xgrammar_cannot_build_is_refused_before_it_runs(tiny_llm):
    bad = {"type": "json_schema", "schema": json.dumps({"type": "tomato"})}
    with pytest.raises(ValueError, match="unsupported JSON schema"):
        check_structured(bad)
    with pytest.raises(ValueError, match="unsupported JSON schema"):
        tiny_llm.generate([1, 2], SamplingParams(structured=bad))
    assert tiny_llm.generate([1, 2], SamplingParams(max_tokens=2))[0].token_ids  # still serving
