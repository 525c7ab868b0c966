"""However a speculating request ends on a decode node, it emits what it would without
speculation, and every KV block is free afterwards (free or cached-free in the allocator).

Real nodes in this process on a tiny random Qwen2 (tests/node_harness.py): a decode node,
colocated or fed by a real prefill node over zmq; the test plays the router. Random weights
rarely repeat themselves, so n-gram lookup would seldom draft what the target accepts: the
engine's proposer is replaced by `ReferenceProposer`, which drafts the unspeculated greedy
continuation with every third drafted token wrong, giving accepted runs and rejections mid-run.
Stops, max_tokens and min_tokens then fall inside accepted runs. (Stop strings are the router's:
tests/test_pd_spec_e2e.py.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from common.engine.config import EngineConfig
from common.engine.sequence import Sequence
from common.engine.spec_decode.proposer import Drafts
from common.node.config import NodeConfig
from common.protocol.messages import (
    Abort,
    DecodeRequest,
    FirstToken,
    Heartbeat,
    PrefillRequest,
    RequestError,
    TokenBatch,
    decode,
)
from common.protocol.sampling_params import SamplingParams
from decode_node.node import DecodeNode
from prefill_node.node import PrefillNode
from tests.node_harness import (
    MAX_STEPS,
    close_nodes,
    drain,
    engine_config,
    pull,
    save_tiny_model,
)
from tests.test_kv_format_refusal import assert_no_block_held

VOCAB = 256  # save_tiny_model's
PROMPTS = {"a": list(range(10, 50)), "b": [7, 3, 9, 200, 41] * 5}
BASE = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
END = "end-of-test-marker"  # the role of the Heartbeat a node sends after its last message


def speculating(engine: EngineConfig, **options: Any) -> EngineConfig:
    spec = dataclasses.replace(
        engine.speculative,
        **{"speculative_method": "ngram", "num_speculative_tokens": 4, **options},
    )
    return dataclasses.replace(engine, speculative=spec)


@dataclass
class Stream:
    """What the router heard for one sample of one request."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    spec_decode: dict[str, Any] | None = None


class Nodes:
    """A decode node, colocated or with a prefill node shipping it KV over zmq, and the router's
    socket both report to."""

    def __init__(
        self, tmp_path, name: str, engine: EngineConfig, pd: bool,
        prefill_engine: EngineConfig | None = None,
    ) -> None:  # fmt: skip
        router_address = f"ipc://{tmp_path}/router-{name}"
        self.router = pull(router_address)
        self.decode_address = f"ipc://{tmp_path}/decode-{name}"
        self.prefill_address = f"ipc://{tmp_path}/prefill-{name}" if pd else None
        decode_config = NodeConfig(
            control_address=self.decode_address, router_address=router_address,
            kv_address="tcp://127.0.0.1:0", transport="zmq", colocated=not pd,
        )  # fmt: skip
        self.decode = DecodeNode(decode_config, engine)
        self.prefill = None
        if pd:
            prefill_config = NodeConfig(
                control_address=self.prefill_address, router_address=router_address,
                transport="zmq",
            )  # fmt: skip
            self.prefill = PrefillNode(prefill_config, prefill_engine or engine)
        self.streams: dict[tuple[str, int], Stream] = {}
        self.errors: list[RequestError] = []

    def send(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.decode.handle(DecodeRequest(request_id, prompt, params, self.prefill_address))
        if self.prefill is not None:
            receiver = self.decode.admission.receiver.address
            self.prefill.handle(
                PrefillRequest(request_id, prompt, params, self.decode_address, receiver)
            )

    def run(self, on_step: Callable[[Nodes], None] = lambda nodes: None) -> None:
        """Step both nodes until neither holds a request (nor has a step in flight)."""
        for _ in range(MAX_STEPS):
            self.decode.step()
            if self.prefill is not None:
                self.prefill.step()
            self._hear()
            on_step(self)
            busy = self.decode.requests or self.decode.core.has_work()
            if not busy and not (self.prefill and self.prefill.jobs):
                self._hear_the_rest()
                return
        raise AssertionError(f"still held: {list(self.decode.requests)}")

    def _hear_the_rest(self) -> None:
        """Messages may still be on their way: each node sends a marker after its last one
        (a socket delivers in order), and the router's socket is read up to every marker."""
        nodes = [n for n in (self.decode, self.prefill) if n is not None]
        for node in nodes:
            node.channel.to_router(Heartbeat(node.channel.node_id, END, {}))
        marked = 0
        while marked < len(nodes):
            message = decode(self.router.recv())  # RECEIVE_TIMEOUT_MS guards against a hang
            if isinstance(message, Heartbeat) and message.role == END:
                marked += 1
            else:
                self._take(message)

    def _hear(self) -> None:
        for message in drain(self.router):
            self._take(message)

    def _take(self, message: object) -> None:
        if isinstance(message, FirstToken):
            self._add(message.request_id, 0, message.token_id, message.logprob,
                      message.top_logprobs, message.finish_reason)  # fmt: skip
        elif isinstance(message, TokenBatch):
            for i, rid in enumerate(message.request_ids):
                stream = self._add(
                    rid,
                    message.indices[i] if message.indices else 0,
                    int(message.token_ids[i]),
                    message.logprobs[i] if message.logprobs else None,
                    message.top_logprobs[i] if message.top_logprobs else None,
                    message.finish_reasons[i],
                )
                if message.spec_decode and message.spec_decode[i]:
                    stream.spec_decode = message.spec_decode[i]
        elif isinstance(message, RequestError):
            self.errors.append(message)

    def _add(self, rid: str, index: int, token: int, logprob, tops, reason) -> Stream:
        stream = self.streams.setdefault((rid, index), Stream())
        assert stream.finish_reason is None, f"{rid}#{index} emitted after it finished"
        stream.token_ids.append(token)
        stream.logprobs.append(logprob)
        stream.top_logprobs.append(tops)
        stream.finish_reason = reason
        return stream

    def assert_nothing_held(self) -> None:
        assert not self.decode.requests and not self.decode.core.has_work()
        allocator = self.decode.worker.allocator
        assert allocator.num_available == allocator.num_blocks, "a block was left behind"
        assert_no_block_held(self.decode, self.prefill)

    def close(self) -> None:
        close_nodes(self.decode, self.prefill, self.router)


class ReferenceProposer:
    """Drafts each prompt's unspeculated greedy continuation, every `wrong_every`-th drafted
    token replaced by `wrong` (default: the next id), which the target rejects."""

    method = "ngram"  # stands in for the configured method

    def __init__(
        self, reference: dict[tuple[int, ...], list[int]], wrong_every: int = 3,
        wrong: int | None = None,
    ) -> None:  # fmt: skip
        self.reference, self.wrong_every, self.wrong = reference, wrong_every, wrong
        self.drafted = 0

    def propose(self, batch, limits: list[int]) -> Drafts:
        drafts = []
        for item, k in zip(batch.items, limits, strict=True):
            seq = item.seq
            n = len(seq.output_token_ids)
            draft = []
            for token in self.reference[tuple(seq.prompt_token_ids)][n : n + k]:
                self.drafted += 1
                if self.drafted % self.wrong_every == 0:
                    token = (token + 1) % VOCAB if self.wrong is None else self.wrong
                draft.append(token)
            drafts.append(draft)
        return Drafts(drafts)

    def release(self, request_id: str) -> None:
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("spec-endings-qwen2"))


@pytest.fixture
def nodes(model_dir, tmp_path):
    made: list[Nodes] = []

    def make(pd: bool, speculate: bool, **options: Any) -> Nodes:
        engine = engine_config(model_dir)
        if speculate:
            engine = speculating(engine, **options)
        made.append(Nodes(tmp_path, f"n{len(made)}", engine, pd))
        return made[-1]

    yield make
    for n in made:
        n.close()


def serve(nodes: Nodes, params: dict[str, SamplingParams], on_step=lambda n: None) -> Nodes:
    for rid, p in params.items():
        nodes.send(rid, PROMPTS[rid], p)
    nodes.run(on_step)
    assert not nodes.errors, nodes.errors
    nodes.assert_nothing_held()
    return nodes


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's unspeculated greedy continuation (BASE), by prompt."""
    plain = Nodes(tmp_path_factory.mktemp("reference"), "ref", engine_config(model_dir), False)
    try:
        serve(plain, dict.fromkeys(PROMPTS, BASE))
        return {tuple(PROMPTS[rid]): plain.streams[rid, 0].token_ids for rid in PROMPTS}
    finally:
        plain.close()


def speculated(nodes: Nodes, reference, **proposer: Any) -> Nodes:
    nodes.decode.core.proposer = ReferenceProposer(reference, **proposer)
    return nodes


def assert_same_streams(spec: Nodes, plain: Nodes) -> None:
    assert spec.streams.keys() == plain.streams.keys()
    for key, want in plain.streams.items():
        got = spec.streams[key]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), key
        for lp, lp_want in zip(got.logprobs, want.logprobs, strict=True):
            assert (lp is None) == (lp_want is None), key
            if lp is not None:
                assert lp == pytest.approx(lp_want, abs=1e-4), key
        for tops, tops_want in zip(got.top_logprobs, want.top_logprobs, strict=True):
            assert (tops is None) == (tops_want is None), key
            if tops is not None:
                assert [t for t, _ in tops] == [t for t, _ in tops_want], key
                assert [lp for _, lp in tops] == pytest.approx(
                    [lp for _, lp in tops_want], abs=1e-4
                )


def stop_at(reference, rid: str, position: int) -> int:
    """The token at `position` of `rid`'s reference, which must not occur before it."""
    tokens = reference[tuple(PROMPTS[rid])]
    token = tokens[position]
    assert token not in tokens[:position], (rid, position, tokens)
    return token


MODES = [pytest.param(False, id="colocated"), pytest.param(True, id="pd")]


@pytest.mark.parametrize("pd", MODES)
@pytest.mark.parametrize("max_tokens", [2, 3, 7, 11])
def test_max_tokens_inside_an_accepted_run_emits_exactly_that_many(
    nodes, reference, pd, max_tokens
):
    params = dict.fromkeys(PROMPTS, dataclasses.replace(BASE, max_tokens=max_tokens))
    plain = serve(nodes(pd, False), params)
    spec = serve(speculated(nodes(pd, True), reference), params)
    assert_same_streams(spec, plain)
    assert all(len(s.token_ids) == max_tokens for s in spec.streams.values())
    if max_tokens > 3:
        assert spec.decode.scheduler.spec_totals.num_accepted_tokens > 0


@pytest.mark.parametrize("pd", MODES)
def test_a_stop_id_inside_an_accepted_run_ends_the_request_there(nodes, reference, pd):
    # Reference positions 9 and 16: past the first token and inside runs of up to 5.
    params = {
        rid: dataclasses.replace(BASE, stop_token_ids=[stop_at(reference, rid, pos)])
        for rid, pos in (("a", 9), ("b", 16))
    }
    plain = serve(nodes(pd, False), params)
    spec = serve(speculated(nodes(pd, True), reference), params)
    assert_same_streams(spec, plain)
    assert [len(spec.streams[rid, 0].token_ids) for rid in "ab"] == [10, 17]
    assert {s.finish_reason for s in spec.streams.values()} == {"stop"}
    counts = spec.streams["a", 0].spec_decode
    assert counts is not None and counts["num_accepted_tokens"] > 0


@pytest.mark.parametrize("pd", MODES)
def test_min_tokens_holds_back_a_stop_id_drafted_too_early(nodes, reference, pd):
    """Every other draft is the stop id itself: before min_tokens the target may not accept
    it (its row is masked as the unspeculated row is). The other drafts follow the unspeculated
    continuation under min_tokens, in which the stop id comes back just after min_tokens."""
    stop = stop_at(reference, "a", 9)
    params = {"a": dataclasses.replace(BASE, min_tokens=12, stop_token_ids=[stop])}
    plain = serve(nodes(pd, False), params)
    tokens = plain.streams["a", 0].token_ids
    assert len(tokens) > 12 and tokens[-1] == stop and stop not in tokens[:-1], tokens
    held_back = {tuple(PROMPTS["a"]): tokens}
    spec = serve(speculated(nodes(pd, True), held_back, wrong_every=2, wrong=stop), params)
    assert_same_streams(spec, plain)
    assert spec.streams["a", 0].finish_reason == "stop"
    totals = spec.decode.scheduler.spec_totals
    assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens


@pytest.mark.parametrize("pd", MODES)
def test_logprobs_of_accepted_tokens_equal_the_unspeculated_ones(nodes, reference, pd):
    params = dict.fromkeys(PROMPTS, dataclasses.replace(BASE, max_tokens=16, logprobs=3))
    plain = serve(nodes(pd, False), params)
    spec = serve(speculated(nodes(pd, True), reference), params)
    assert_same_streams(spec, plain)
    assert all(s.logprobs[-1] is not None and len(s.top_logprobs[-1]) == 3
               for s in spec.streams.values())  # fmt: skip
    assert spec.decode.scheduler.spec_totals.num_accepted_tokens > 0


@pytest.mark.parametrize("pd", MODES)
def test_n_greedy_samples_each_emit_the_unspeculated_tokens(nodes, reference, pd):
    params = {"a": dataclasses.replace(BASE, n=3, max_tokens=12), "b": BASE}
    plain = serve(nodes(pd, False), params)
    spec = serve(speculated(nodes(pd, True), reference), params)
    assert_same_streams(spec, plain)
    assert sorted(spec.streams) == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    assert all(spec.streams["a", i].spec_decode["num_accepted_tokens"] > 0 for i in (1, 2))


def running(n: Nodes, seq_id: str) -> Sequence | None:
    """The sample `seq_id` (`<request id>` or `<request id>#<index>`) if it is decoding."""
    return next((s for s in n.decode.scheduler.running if s.request_id == seq_id), None)


@pytest.mark.parametrize("pd", MODES)
def test_an_abort_between_verify_steps_frees_every_block_and_spares_the_other_request(
    nodes, reference, pd
):
    params = dict.fromkeys(PROMPTS, BASE)
    aborted: list[int] = []

    def abort_a_mid_run(n: Nodes) -> None:  # what it emitted was sent: the node's own count
        seq = running(n, "a")
        if not aborted and seq is not None and seq.spec.num_accepted_tokens > 0:
            aborted.append(len(seq.output_token_ids))
            n.decode.handle(Abort("a"))

    spec = serve(speculated(nodes(pd, True), reference), params, abort_a_mid_run)
    assert aborted and aborted[0] < BASE.max_tokens
    a, b = spec.streams["a", 0], spec.streams["b", 0]
    assert a.finish_reason is None and a.token_ids == reference[tuple(PROMPTS["a"])][: aborted[0]]
    assert b.token_ids == reference[tuple(PROMPTS["b"])] and b.finish_reason == "length"


@pytest.mark.parametrize("pd", MODES)
def test_an_abort_of_one_sample_mid_run_frees_its_blocks_and_the_others_finish(
    nodes, reference, pd
):
    params = {"a": dataclasses.replace(BASE, n=3, max_tokens=24)}
    aborted: list[int] = []

    def abort_sample_1(n: Nodes) -> None:
        seq = running(n, "a#1")
        if not aborted and seq is not None and seq.spec.num_accepted_tokens > 0:
            aborted.append(len(seq.output_token_ids))
            n.decode.handle(Abort("a", index=1))

    spec = serve(speculated(nodes(pd, True), reference), params, abort_sample_1)
    want = reference[tuple(PROMPTS["a"])]
    assert aborted and aborted[0] < 24
    assert spec.streams["a", 1].token_ids == want[: aborted[0]]
    assert spec.streams["a", 1].finish_reason is None
    for i in (0, 2):
        assert spec.streams["a", i].token_ids == want[:24]
