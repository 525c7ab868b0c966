"""Node selection: pure policy functions, the load ledger, and the core's use of both."""

from __future__ import annotations

import asyncio

from common.messages import FirstToken
from common.sampling_params import SamplingParams
from router.config import RouterConfig
from router.core import RouterCore
from router.metrics import RouterMetrics
from router.policy import Candidate, LoadLedger, pick_decode, pick_prefill
from router.prepare import PreparedRequest
from tests.router_fakes import LoopbackNodes, heartbeat


def test_decode_choice_prefers_most_free_blocks():
    nodes = [Candidate("a", free_blocks=10, running=0), Candidate("b", free_blocks=50, running=9)]
    assert pick_decode(nodes) == "b"


def test_decode_choice_breaks_free_block_ties_by_fewest_running_then_id():
    nodes = [
        Candidate("c", free_blocks=50, running=3),
        Candidate("b", free_blocks=50, running=1),
        Candidate("a", free_blocks=50, running=1),
    ]
    assert pick_decode(nodes) == "a"


def test_prefill_choice_prefers_fewest_queued_tokens():
    nodes = [Candidate("a", queued_tokens=900), Candidate("b", queued_tokens=100)]
    assert pick_prefill(nodes) == "b"


def test_no_candidates_means_no_choice():
    assert pick_decode([]) is None
    assert pick_prefill([]) is None


def test_ledger_counts_prompt_tokens_until_the_first_token():
    ledger = LoadLedger()
    ledger.sent("r1", "p", 100, "d", 7)
    ledger.sent("r2", "p", 50, "d", 4)
    assert ledger.prefill_tokens("p") == 150
    ledger.prefill_done("r1")
    ledger.prefill_done("r1")  # idempotent
    assert ledger.prefill_tokens("p") == 50
    ledger.release("r2")
    assert ledger.prefill_tokens("p") == 0


def test_ledger_forgets_decode_blocks_once_the_node_reports_its_load():
    ledger = LoadLedger()
    ledger.sent("r1", None, 100, "d1", 7)
    ledger.sent("r2", None, 30, "d2", 2)
    assert ledger.decode_pending("d1") == (7, 1)
    ledger.decode_reported("d1")
    assert ledger.decode_pending("d1") == (0, 0)
    assert ledger.decode_pending("d2") == (2, 1)
    ledger.release("r1")  # already forgotten: no negative counts
    assert ledger.decode_pending("d1") == (0, 0)


def _prepared(n: int) -> PreparedRequest:
    return PreparedRequest(
        "completion", list(range(n)), SamplingParams(max_tokens=4), False, False, False
    )


def test_burst_between_heartbeats_spreads_over_decode_and_prefill_nodes():
    config = RouterConfig(prefill=("p1", "p2"), decode=("d1", "d2"))
    core = RouterCore(config, RouterMetrics(), link=LoopbackNodes(), clock=lambda: 10.0)
    for node, role in [("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode")]:
        core.on_message(heartbeat(node, role, free_blocks=100))

    async def burst() -> list[tuple[str | None, str]]:
        chosen = []
        for i in range(2):
            route = core.route()
            core.dispatch(f"r{i}", _prepared(64), route)
            chosen.append((route.prefill, route.decode))
        return chosen

    assert asyncio.run(burst()) == [("p1", "d1"), ("p2", "d2")]


def test_first_token_returns_prompt_tokens_to_the_prefill_node():
    config = RouterConfig(prefill=("p1", "p2"), decode=("d1",))
    core = RouterCore(config, RouterMetrics(), link=LoopbackNodes(), clock=lambda: 10.0)
    for node, role in [("p1", "prefill"), ("p2", "prefill"), ("d1", "decode")]:
        core.on_message(heartbeat(node, role))

    async def scenario() -> str | None:
        core.dispatch("r0", _prepared(500), core.route())  # to p1
        core.on_message(FirstToken("r0", 5, None, None, False, None, 0, {}))
        return core.route().prefill

    assert asyncio.run(scenario()) == "p1"
