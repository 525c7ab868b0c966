"""EAGLE-3 across the prefill/decode split: the prefill node ships each prompt's target hidden
states with its KV (common/engine/spec_decode/aux_rows.py), so the decode node's head sees every
prompt position, as a colocated node's head does after its own prefill.

Real nodes in this process (tests/test_spec_endings.py's `Nodes`: a prefill node shipping over
zmq, a decode node) on the tiny random Llama target and tiny random head of
tests/test_spec_eagle3.py. The drafts each head proposes are recorded from the real proposer:
same head inputs, same drafts.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from common.engine.config import SpeculativeConfig
from common.engine.spec_decode.aux_rows import (
    AUX_ROWS_KEY,
    PromptAuxRows,
    observe_shipped,
    rows_from_wire,
)
from common.engine.spec_decode.loading import keep_eagle3_inputs
from common.engine.spec_decode.proposer import Drafts
from common.model.loader import build_model
from common.model.source import read_spec, resolve_model
from common.protocol.sampling_params import SamplingParams
from kv_transfer.base import TransferConfig, TransferState
from kv_transfer.frames import MAX_HEADER_BYTES
from kv_transfer.pool_io import as_bytes
from kv_transfer.zmq_transport import ZmqReceiver, ZmqSender
from tests.node_harness import engine_config
from tests.test_kv_transfer import poll_until_terminal
from tests.test_spec_eagle3 import EPS, HEADS, INTER, KV_HEADS, TARGET_LAYERS, VOCAB, H, write_head
from tests.test_spec_endings import Nodes, speculating

PROMPTS = {"a": list(range(10, 50)), "b": [7, 3, 9, 200, 41] * 5, "c": [5, 6]}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER,
        num_hidden_layers=TARGET_LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, max_position_embeddings=512, initializer_range=0.25,
        rms_norm_eps=EPS,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("eagle3-pd-target")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("eagle3-pd-head")
    write_head(folder)
    return str(folder)


class Served:
    """What one stack emitted, what its decode node's head drafted, and how many head rows ran
    on a zero hidden state."""

    def __init__(self, nodes: Nodes, params: SamplingParams) -> None:
        proposer = nodes.decode.core.proposer
        self.drafts: dict[str, list[list[int]]] = {rid: [] for rid in PROMPTS}
        if proposer is not None:
            propose = proposer.propose

            def recording(batch, limits) -> Drafts:
                out = propose(batch, limits)
                for item, drafts in zip(batch.items, out.token_ids, strict=True):
                    # A sequence with no room left gets an empty draft, but only in steps the
                    # batch speculates at all, which depends on when its neighbour arrived.
                    if drafts:
                        self.drafts[item.seq.request_id].append(list(drafts))
                return out

            proposer.propose = recording
        try:
            for rid, prompt in PROMPTS.items():
                nodes.send(rid, prompt, params)
            nodes.run()
            assert not nodes.errors, nodes.errors
            nodes.assert_nothing_held()
            self.unobserved = getattr(proposer, "num_unobserved_rows", None)
            self.stats = dict(nodes.decode.stats)
            self.tokens = {rid: nodes.streams[rid, 0].token_ids for rid in PROMPTS}
            self.spec = {rid: nodes.streams[rid, 0].spec_decode for rid in PROMPTS}
        finally:
            nodes.close()


def test_pd_eagle3_ships_prompt_hidden_states_and_drafts_as_colocated(
    target_dir, head_dir, tmp_path
):
    plain = engine_config(target_dir)
    eagle = speculating(plain, speculative_method="eagle3", speculative_model=head_dir)
    want = Served(Nodes(tmp_path, "plain", plain, pd=False), GREEDY)
    pd = Served(Nodes(tmp_path, "pd", eagle, pd=True), GREEDY)
    colocated = Served(Nodes(tmp_path, "colocated", eagle, pd=False), GREEDY)
    assert pd.tokens == colocated.tokens == want.tokens  # greedy: exact
    # Every prompt position reached the decode node's head with its real hidden state ...
    assert pd.unobserved == colocated.unobserved == 0
    assert pd.stats["eagle3_aux_rows_received"] == sum(len(p) for p in PROMPTS.values())
    # ... so it drafts what the colocated head drafts, and the target accepts the same.
    assert pd.drafts == colocated.drafts
    assert all(pd.drafts[rid] for rid in PROMPTS)
    assert pd.spec == colocated.spec
    assert all(s["num_drafts"] > 0 for s in pd.spec.values()), pd.spec


def test_a_prefill_prefix_cache_hit_ships_the_rest_and_the_head_counts_the_gap(
    target_dir, head_dir, tmp_path
):
    """The prefill node computes (and ships) only the positions its prefix cache missed; the
    head runs the cached ones on zeros, and the output stays exact."""
    eagle = speculating(
        engine_config(target_dir), speculative_method="eagle3", speculative_model=head_dir
    )
    nodes = Nodes(tmp_path, "cached", eagle, pd=True)
    try:
        prompt = PROMPTS["a"]
        nodes.send("first", prompt, GREEDY)
        nodes.run()
        nodes.send("again", prompt, GREEDY)
        nodes.run()
        assert not nodes.errors, nodes.errors
        assert nodes.streams["again", 0].token_ids == nodes.streams["first", 0].token_ids
        cached = nodes.prefill.load()["prefix_cache_hits"]
        assert cached == 32  # two full blocks of 16
        assert nodes.decode.core.proposer.num_unobserved_rows == cached
        assert nodes.decode.stats["eagle3_aux_rows_received"] == 2 * len(prompt) - cached
    finally:
        nodes.close()


def test_only_the_last_rows_that_fit_the_budget_are_kept_and_they_round_trip():
    width = 6
    rows = PromptAuxRows(max_bytes=4 * width * 2)  # four bf16 rows
    rows.expect("r", 10)
    aux = torch.randn(10, width).to(torch.bfloat16)
    rows.observe(["other", "r"], [0, 0], [3, 7], torch.cat([aux[:3], aux[:7]]))
    rows.observe(["r"], [7], [3], aux[7:])
    wire, payload = rows.to_wire("r")
    assert (wire["start"], wire["shape"], wire["dtype"]) == (6, [4, width], "bfloat16")
    assert "data" not in wire  # the rows travel as the completion's payload frame
    assert payload.nbytes == 4 * width * 2  # 3 x hidden x 2 bytes per token
    start, back = rows_from_wire(wire, as_bytes(payload).tobytes(), width, 10)
    assert start == 6 and torch.equal(back, aux[6:])
    assert rows.to_wire("r") is None  # forgotten once shipped


@pytest.mark.parametrize(
    "change, message",
    [
        ({"shape": [4, 5]}, "do not fit"),
        ({"start": 7}, "do not fit"),
        ({"dtype": "int8"}, "dtype"),
        ({"payload": b"\0" * 10}, "are not 10 bytes"),
        ({"payload": None}, "need a payload, got NoneType"),
    ],
)
def test_shipped_rows_that_do_not_fit_the_prompt_or_head_are_refused(change, message):
    wire = {"start": 6, "dtype": "bfloat16", "shape": [4, 6], **change}
    payload = wire.pop("payload", b"\0" * 48)
    with pytest.raises(ValueError, match=message):
        rows_from_wire(wire, payload, 6, 10)


def test_rows_past_the_old_header_cap_ship_whole_over_zmq():
    """1024 positions of Llama-3.1-8B's width (24 MiB, beyond the 16 MiB a completion header
    may hold) go as the completion's payload frame over real zmq sockets, every row intact."""
    width, n = 3 * 4096, 1024
    rows = PromptAuxRows()
    rows.expect("r", n)
    aux = torch.randn(n, width).to(torch.bfloat16)
    rows.observe(["r"], [0], [n], aux)
    wire, payload = rows.to_wire("r")
    assert payload.nbytes > MAX_HEADER_BYTES
    pool = torch.zeros(1, 2, 2, 1, 1, 1)
    config = TransferConfig(deadline_s=60)
    with ZmqReceiver(pool.clone(), config, "tcp://127.0.0.1:0") as receiver:
        receiver.expect("r", [0])
        with ZmqSender(pool, config) as sender:
            sender.begin("r", receiver.address, [1], [0])
            sender.send_layer("r", 0)
            sender.complete("r", {AUX_ROWS_KEY: wire}, payload)
            [sent] = sender.poll()
            assert sent.state is TransferState.DONE
            landed = poll_until_terminal(receiver, {"r"})["r"]
    assert landed.state is TransferState.DONE, landed.error
    start, back = rows_from_wire(landed.metadata[AUX_ROWS_KEY], landed.payload, width, n)
    assert start == 0 and torch.equal(back, aux)


def test_refused_rows_leave_the_request_decoding_exactly(target_dir, head_dir, tmp_path):
    """A prefill node shipping rows of the wrong width: the decode node drops them with a
    warning and decodes the exact tokens from zero hidden states."""
    plain = engine_config(target_dir)
    eagle = speculating(plain, speculative_method="eagle3", speculative_model=head_dir)
    nodes = Nodes(tmp_path, "bad", eagle, pd=True)
    complete = nodes.prefill.sender.complete

    def narrower(request_id, metadata, payload=None):
        shipped = metadata[AUX_ROWS_KEY]
        n, width = shipped["shape"]
        metadata[AUX_ROWS_KEY] = {**shipped, "shape": [n, width - 1]}
        complete(request_id, metadata, b"\0" * (n * (width - 1) * 4))

    nodes.prefill.sender.complete = narrower
    try:
        nodes.send("a", PROMPTS["a"], GREEDY)
        nodes.run()
        assert not nodes.errors, nodes.errors
        assert nodes.decode.stats["eagle3_aux_rows_refused"] == 1
        assert nodes.decode.core.proposer.num_unobserved_rows == len(PROMPTS["a"])
        got = nodes.streams["a", 0].token_ids
    finally:
        nodes.close()
    want = Served(Nodes(tmp_path, "plain2", plain, pd=False), GREEDY).tokens["a"]
    assert got == want


def test_observe_shipped_feeds_the_proposer_in_its_dtype(target_dir, head_dir, tmp_path):
    """The decode side alone: bf16 rows from the wire enter a float32 head's state."""
    eagle = speculating(
        engine_config(target_dir), speculative_method="eagle3", speculative_model=head_dir
    )
    nodes = Nodes(tmp_path, "alone", eagle, pd=False)
    try:
        proposer = nodes.decode.core.proposer
        aux = torch.randn(5, 3 * H).to(torch.bfloat16)
        wire = {"start": 2, "dtype": "bfloat16", "shape": [5, 3 * H]}
        assert observe_shipped(proposer, "x", wire, as_bytes(aux).tobytes(), 8) == 5
        state = proposer._states["x"]
        assert state.start == 2 and torch.equal(state.hidden, aux.float())
        proposer.release("x")
        assert "x" not in proposer._states
    finally:
        nodes.close()


def test_a_prefill_target_keeps_the_heads_layers_from_its_config_alone(target_dir, tmp_path):
    source = resolve_model(target_dir)
    target = build_model(read_spec(source), source, max_positions=64, dtype=torch.float32,
                         device=torch.device("cpu"))  # fmt: skip
    head = tmp_path / "head"
    write_head(head)
    (head / "model.safetensors").unlink()  # no weights needed
    config = SpeculativeConfig("eagle3", 4, str(head))
    assert keep_eagle3_inputs(config, target) == (2, 4, 5)  # default: early, middle, late
    assert target.model.aux_hidden_layers == (2, 4, 5)
    write_head(tmp_path / "wide", target_hidden_size=2 * H)
    with pytest.raises(ValueError, match=f"size {2 * H}, the target's are {H}"):
        keep_eagle3_inputs(SpeculativeConfig("eagle3", 4, str(tmp_path / "wide")), target)
