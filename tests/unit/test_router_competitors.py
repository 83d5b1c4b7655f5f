"""The competitors' routing rules (Dynamo's KV cost, llm-d's weighted scorers) on hand-built fleets."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from router_svc.competitors import DynamoKv, LlmD
from router_svc.core import ReplicaLoad, ReplicaSpec, RouteQuery, RouterConfig, RouterCore, RoutingPolicy
from sluice.hashing import hash_chain, salt_of
from sluice.types import KvEvent, KvEventKind

SALT = salt_of("m")
TOKENS = list(range(512))  # 32 blocks of 16
CHAIN = hash_chain(TOKENS, 16, SALT)


def fleet(policy: RoutingPolicy, rows: dict[str, tuple[int, int, int, int]]) -> RouterCore:
    """Replicas of 100 blocks; each row is (cached prefix blocks, waiting, queued prefill tokens, used blocks)."""
    router = RouterCore(RouterConfig(policy=policy, prediction_ttl_s=10.0))
    for rid, (cached, waiting, queued, used) in rows.items():
        router.register(ReplicaSpec(rid, "m", num_blocks=100, block_size=16), now=0.0)
        router.mark_ready(rid, now=0.0)
        if cached:
            assert router.apply_kv_events(rid, [KvEvent(1, KvEventKind.STORED, tuple(CHAIN[:cached]))], now=0.0)
        router.heartbeat(rid, ReplicaLoad(waiting=waiting, queued_prefill_tokens=queued, kv_blocks_free=100 - used),
                         now=0.0)
    return router


def query(request_id: str = "q") -> RouteQuery:
    return RouteQuery(request_id, "m", block_hashes=tuple(CHAIN), prompt_tokens=len(TOKENS))


def test_dynamo_cost_is_overlap_weight_times_prefill_blocks_plus_active_blocks() -> None:
    """A: (320 queued + 192 uncached) / 16 + 5 used = 37; B: 512/16 + 10 = 42; C: (160 + 512)/16 + 0 = 42 -> A.
    Routed there, A carries 192 more prompt tokens and is predicted to hold the whole prompt:
    (320 + 192 + 0) / 16 + 5 + 12 = 49 > 42, so the next one goes to B or C."""
    router = fleet(RoutingPolicy.DYNAMO_KV, {"A": (20, 0, 320, 5), "B": (0, 0, 0, 10), "C": (0, 0, 160, 0)})
    policy = router.policy
    assert isinstance(policy, DynamoKv) and (policy.overlap_weight, policy.temperature) == (1.0, 0.0)
    ready = router.fleet.ready_for("m", "")
    assert [policy.cost(r, query(), 0.0) for r in ready] == [37.0, 42.0, 42.0]
    assert router.route(query("1"), now=0.0).replica_id == "A"
    assert policy.cost(router.fleet.get("A"), query(), 0.0) == 49.0
    assert router.route(query("2"), now=0.0).replica_id in {"B", "C"}


def test_dynamo_temperature_samples_the_softmax_of_min_max_normalised_costs() -> None:
    """With temperature 0.5 over costs 37, 42, 42 (normalised 0, 1, 1), A is drawn with probability
    1 / (1 + 2 e^-2) and B, C share the rest; draws from the seeded generator match within 3%."""
    router = fleet(RoutingPolicy.DYNAMO_KV, {"A": (20, 0, 320, 5), "B": (0, 0, 0, 10), "C": (0, 0, 160, 0)})
    policy = DynamoKv(router.index.cached, random.Random(1), temperature=0.5)
    ready = router.fleet.ready_for("m", "")
    draws = Counter(policy.choose(ready, query(), 0.0).spec.replica_id for _ in range(4000))
    expected_a = 1 / (1 + 2 * math.exp(-2))
    assert draws["A"] / 4000 == pytest.approx(expected_a, abs=0.03)
    assert draws["B"] / 4000 == pytest.approx((1 - expected_a) / 2, abs=0.03)


def test_llm_d_sums_prefix_3_queue_2_kv_utilisation_2() -> None:
    """A: 3 x 32/32 + 2 x (4-4)/4 + 2 x (1-0.40) = 4.2; B: 0 + 2 x 1 + 2 x 1 = 4.0; C: 0 + 2 x 0.5 + 2 x 0.8 = 2.6
    -> A, the highest."""
    router = fleet(RoutingPolicy.LLM_D, {"A": (32, 4, 0, 40), "B": (0, 0, 0, 0), "C": (0, 2, 0, 20)})
    policy = router.policy
    assert isinstance(policy, LlmD) and policy.weights == (3.0, 2.0, 2.0)
    assert policy.scores(router.fleet.ready_for("m", ""), query(), 0.0) == pytest.approx([4.2, 4.0, 2.6])
    assert router.route(query(), now=0.0).replica_id == "A"


def test_llm_d_gives_every_replica_a_full_queue_score_when_queues_are_equal() -> None:
    """Equal waiting queues score 1 each (the queue scorer's neutral case): B wins on KV utilisation alone."""
    router = fleet(RoutingPolicy.LLM_D, {"A": (0, 3, 0, 50), "B": (0, 3, 0, 10)})
    assert router.policy.scores(router.fleet.ready_for("m", ""), query(), 0.0) == pytest.approx(  # type: ignore[attr-defined]
        [2 + 2 * 0.5, 2 + 2 * 0.9])
    assert router.route(query(), now=0.0).replica_id == "B"


def test_competitors_are_named_policies_that_read_the_prefix_index() -> None:
    """`dynamo_kv` and `llm_d` parse as routing policies and ask callers to hash prompts; round robin does not."""
    assert RoutingPolicy.parse("dynamo_kv") is RoutingPolicy.DYNAMO_KV and RoutingPolicy.parse("llm_d").uses_prefix
    assert not RoutingPolicy.ROUND_ROBIN.uses_prefix and RoutingPolicy.SCORE.uses_prefix


def test_bounded_load_score_spills_a_hot_prefix_over_instead_of_herding() -> None:
    """A holds the whole prompt and is fastest by predicted TTFT, but with 3 requests routed there and none
    elsewhere (cap ceil(1.25 x 4 / 2) = 3) the bound makes B the only candidate; without the bound A wins."""
    for bound, expected in ((0.0, "A"), (1.25, "B")):
        router = RouterCore(RouterConfig(policy=RoutingPolicy.SCORE, load_bound=bound, prediction_ttl_s=10.0))
        for rid in ("A", "B"):
            router.register(ReplicaSpec(rid, "m", num_blocks=100, block_size=16), now=0.0)
            router.mark_ready(rid, now=0.0)
        assert router.apply_kv_events("A", [KvEvent(1, KvEventKind.STORED, tuple(CHAIN))], now=0.0)
        router.fleet.get("A").inflight.update({"x": 0, "y": 0, "z": 0})
        assert router.route(query(), now=0.0).replica_id == expected
