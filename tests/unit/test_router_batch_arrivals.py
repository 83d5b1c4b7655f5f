"""A batch of simultaneous arrivals that share only their first block: llm-d's documented scorers send the whole
batch to one replica (their load signals are scraped, so they do not move within a batch, and the prefix the
router itself recorded for the first request outweighs them), while SCORE and Dynamo's cost, which count the
work routed since the last report, spread it."""

from __future__ import annotations

from collections import Counter

import pytest

from router_svc.core import ReplicaLoad, ReplicaSpec, RouteQuery, RouterConfig, RouterCore, RoutingPolicy
from sluice.hashing import hash_chain, salt_of

SALT = salt_of("m")


def _fleet(policy: RoutingPolicy) -> RouterCore:
    router = RouterCore(RouterConfig(policy=policy, seed=3))
    for i in range(4):
        router.register(ReplicaSpec(f"r{i}", "m", num_blocks=10_000, block_size=16, prefill_tokens_per_s=10_000.0),
                        now=0.0)
        router.mark_ready(f"r{i}", now=0.0)
        router.heartbeat(f"r{i}", ReplicaLoad(kv_blocks_free=10_000), now=0.0)
    return router


def _batch(size: int) -> list[RouteQuery]:
    """`size` prompts of 1,024 tokens sharing their first 16-token block (a system prompt's first block)."""
    out = []
    for i in range(size):
        tokens = list(range(16)) + [1000 + 1008 * i + k for k in range(1008)]
        out.append(RouteQuery(f"q{i}", "m", block_hashes=tuple(hash_chain(tokens, 16, SALT)), prompt_tokens=1024))
    return out


def _placement(policy: RoutingPolicy) -> Counter[str]:
    router = _fleet(policy)
    return Counter(router.route(q, now=0.01).replica_id for q in _batch(16))  # one instant, no heartbeat between


def test_llm_d_sends_a_simultaneous_batch_sharing_one_block_to_one_replica() -> None:
    """Sixteen requests at one instant: llm-d's queue and KV scores are equal on every replica until the next
    scrape, and the first request's recorded prefix (1 of its 64 blocks) tips every later one to its replica."""
    assert len(_placement(RoutingPolicy.LLM_D)) == 1


@pytest.mark.parametrize("policy", [RoutingPolicy.SCORE, RoutingPolicy.DYNAMO_KV])
def test_score_and_dynamo_spread_the_same_batch_over_the_fleet(policy: RoutingPolicy) -> None:
    """The same batch under SCORE or Dynamo's cost: each request counts the prompt tokens routed before it,
    so the batch is spread over all four replicas, four each."""
    assert sorted(_placement(policy).values()) == [4, 4, 4, 4]
