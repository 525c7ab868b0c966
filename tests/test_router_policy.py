"""Node selection: pure policy functions, the load ledger, and the core's use of both."""

from __future__ import annotations

import asyncio

import pytest

from common.protocol.messages import FirstToken
from common.protocol.sampling_params import SamplingParams
from router.config import RouterConfig
from router.core import RouterCore
from router.metrics import RouterMetrics
from router.policy import Candidate, LoadLedger, PolicyConfig, RoutingPolicy, create_policy
from router.prefix_index import PrefixIndex, chained_block_hashes
from router.prepare import PreparedRequest
from tests.router_fakes import LoopbackNodes, heartbeat

CONFIG = PolicyConfig(block_tokens=4, min_match_ratio=0.25, balance_abs_tokens=100)


def least_load(pool: str) -> RoutingPolicy:
    return create_policy("least_load", pool, CONFIG)


def test_least_load_decode_prefers_most_free_blocks():
    nodes = [Candidate("a", free_blocks=10, running=0), Candidate("b", free_blocks=50, running=9)]
    assert least_load("decode").choose(nodes, []) == "b"


def test_least_load_decode_breaks_free_block_ties_by_fewest_running_then_id():
    nodes = [
        Candidate("c", free_blocks=50, running=3),
        Candidate("b", free_blocks=50, running=1),
        Candidate("a", free_blocks=50, running=1),
    ]
    assert least_load("decode").choose(nodes, []) == "a"


def test_least_load_prefill_prefers_fewest_queued_tokens():
    nodes = [Candidate("a", queued_tokens=900), Candidate("b", queued_tokens=100)]
    assert least_load("prefill").choose(nodes, []) == "b"


def test_no_candidates_means_no_choice():
    for name, pool in [
        ("least_load", "decode"),
        ("round_robin", "prefill"),
        ("cache_aware", "prefill"),
    ]:
        assert create_policy(name, pool, CONFIG).choose([], [1, 2, 3]) is None


def test_round_robin_takes_the_nodes_in_turn_whatever_their_load():
    policy = create_policy("round_robin", "decode", CONFIG)
    nodes = [Candidate("b", free_blocks=1), Candidate("a", free_blocks=99)]
    assert [policy.choose(nodes, []) for _ in range(5)] == ["a", "b", "a", "b", "a"]


def test_round_robin_skips_a_node_that_left_the_pool():
    policy = create_policy("round_robin", "prefill", CONFIG)
    three = [Candidate("a"), Candidate("b"), Candidate("c")]
    assert [policy.choose(three, []) for _ in range(2)] == ["a", "b"]
    assert policy.choose([Candidate("a"), Candidate("b")], []) == "a"


def test_unknown_policy_and_cache_aware_for_decode_are_refused():
    with pytest.raises(ValueError, match="unknown routing policy"):
        create_policy("random", "prefill", CONFIG)
    with pytest.raises(ValueError, match="prefill requests only"):
        create_policy("cache_aware", "decode", CONFIG)


SHARED = list(range(100, 116))  # four blocks of four tokens


def test_cache_aware_sends_a_prompt_to_the_node_holding_its_longest_prefix():
    policy = create_policy("cache_aware", "prefill", CONFIG)
    nodes = [Candidate("a"), Candidate("b")]
    policy.sent("b", SHARED + [1, 2, 3, 4])
    policy.sent("a", SHARED[:4] + [9, 9, 9, 9])
    assert policy.choose(nodes, SHARED + [5, 6, 7, 8]) == "b"  # 4 blocks on b, 1 on a


def test_cache_aware_spreads_new_prefixes_to_the_least_loaded_then_smallest_tree():
    policy = create_policy("cache_aware", "prefill", CONFIG)
    policy.sent("a", SHARED)
    nodes = [Candidate("a"), Candidate("b")]
    assert policy.choose(nodes, list(range(500, 520))) == "b"  # no match: b's tree is empty
    loaded = [Candidate("a", queued_tokens=0), Candidate("b", queued_tokens=50)]
    assert policy.choose(loaded, list(range(500, 520))) == "a"


def test_cache_aware_ignores_a_match_shorter_than_the_threshold():
    policy = create_policy("cache_aware", "prefill", CONFIG)
    policy.sent("a", SHARED[:4])
    nodes = [Candidate("a", queued_tokens=10), Candidate("b", queued_tokens=0)]
    prompt = SHARED[:4] + list(range(900, 920))  # 4 of 24 tokens cached on a: < 25 %
    assert policy.choose(nodes, prompt) == "b"


def test_cache_aware_routes_by_load_when_the_pool_is_out_of_balance():
    policy = create_policy("cache_aware", "prefill", CONFIG)
    policy.sent("a", SHARED)
    balanced = [Candidate("a", queued_tokens=90), Candidate("b", queued_tokens=0)]
    assert policy.choose(balanced, SHARED) == "a"  # gap 90 <= 100 tokens: the cache wins
    skewed = [Candidate("a", queued_tokens=200), Candidate("b", queued_tokens=0)]
    assert policy.choose(skewed, SHARED) == "b"


def test_cache_aware_forgets_a_lost_node():
    policy = create_policy("cache_aware", "prefill", CONFIG)
    policy.sent("a", SHARED)
    policy.node_lost("a")
    nodes = [Candidate("a", queued_tokens=5), Candidate("b")]
    assert policy.choose(nodes, SHARED) == "b"


def test_prefix_index_matches_leading_blocks_per_node():
    index = PrefixIndex(default_capacity=100)
    hashes = chained_block_hashes(SHARED, 4)
    index.insert("a", hashes)
    index.insert("b", hashes[:2])
    assert index.match(hashes, ["a", "b", "c"]) == {"a": 4, "b": 2, "c": 0}
    other = chained_block_hashes([0, 0, 0, 0] + SHARED[4:], 4)
    assert index.match(other, ["a", "b"]) == {"a": 0, "b": 0}  # same blocks, other parent


def test_prefix_index_evicts_least_recent_leaves_first_and_stays_bounded():
    index = PrefixIndex(default_capacity=6)
    old = chained_block_hashes(list(range(16)), 4)
    new = chained_block_hashes(list(range(100, 116)), 4)
    index.insert("a", old)
    index.insert("a", new)  # 8 blocks for a capacity of 6: two of `old` go, leaves first
    assert index.size("a") == 6
    assert index.match(old, ["a"]) == {"a": 2}
    assert index.match(new, ["a"]) == {"a": 4}
    index.set_capacity("a", 3)
    assert index.size("a") == 3
    assert index.match(new, ["a"]) == {"a": 3}


def test_prefix_index_capacity_follows_the_node_kv_pool():
    policy = create_policy("cache_aware", "prefill", CONFIG)
    policy.choose([Candidate("a", kv_blocks=2)], SHARED)
    policy.sent("a", SHARED)
    assert policy.index.size("a") == 2


def test_prefix_index_removing_a_node_drops_only_its_tree():
    index = PrefixIndex(default_capacity=100)
    hashes = chained_block_hashes(SHARED, 4)
    index.insert("a", hashes)
    index.insert("b", hashes)
    index.remove_node("a")
    assert index.match(hashes, ["a", "b"]) == {"a": 0, "b": 4}
    assert index.size("a") == 0


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


def _prepared(n: int | list[int]) -> PreparedRequest:
    ids = list(range(n)) if isinstance(n, int) else n
    return PreparedRequest("completion", ids, SamplingParams(max_tokens=4), False, False, False)


def test_burst_between_heartbeats_spreads_over_decode_and_prefill_nodes():
    config = RouterConfig(prefill=("p1", "p2"), decode=("d1", "d2"))
    core = RouterCore(config, RouterMetrics(), link=LoopbackNodes(), clock=lambda: 10.0)
    for node, role in [("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode")]:
        core.on_message(heartbeat(node, role, free_blocks=100))

    async def burst() -> list[tuple[str | None, str]]:
        chosen = []
        for i in range(2):
            route = core.route(list(range(64)))
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
        core.dispatch("r0", _prepared(500), core.route(list(range(500))))  # to p1
        core.on_message(FirstToken("r0", 5, None, None, False, None, 0, {}))
        return core.route([1]).prefill

    assert asyncio.run(scenario()) == "p1"


def test_core_routes_repeated_prefixes_to_one_prefill_node_with_cache_aware():
    config = RouterConfig(
        prefill=("p1", "p2"),
        decode=("d1",),
        prefill_policy="cache_aware",
        decode_policy="round_robin",
    )
    core = RouterCore(config, RouterMetrics(), link=LoopbackNodes(), clock=lambda: 10.0)
    for node, role in [("p1", "prefill"), ("p2", "prefill"), ("d1", "decode")]:
        core.on_message(heartbeat(node, role))
    system = list(range(1000, 1064))  # a shared 64-token "system prompt"

    async def scenario() -> list[str | None]:
        chosen = []
        for i, prefix in enumerate([system, list(range(2000, 2064)), system, system]):
            route = core.route(prefix + [i])
            core.dispatch(f"r{i}", _prepared(prefix + [i]), route)
            core.on_message(FirstToken(f"r{i}", 5, None, None, False, None, 0, {}))
            chosen.append(route.prefill)
        return chosen

    # The second prefix is new: it goes to the node with the smaller tree; the system prompt
    # keeps going where it is cached although p2 has the same (zero) load and tree size.
    assert asyncio.run(scenario()) == ["p1", "p2", "p1", "p1"]
