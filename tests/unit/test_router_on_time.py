"""SCORE's prefill weight with a TTFT target: a cache hit never sends a request where it is predicted late while
another replica is predicted on time (the request admission's early refusal would otherwise refuse)."""

from __future__ import annotations

from router_svc.core import ReplicaLoad, ReplicaSpec, RouteQuery, RouterConfig, RouterCore
from sluice.hashing import hash_chain, salt_of
from sluice.types import KvEvent, KvEventKind

SALT = salt_of("m")
TOKENS = list(range(4096))  # 256 blocks: 0.4 s of prefill at 10,000 tokens/s
CHAIN = tuple(hash_chain(TOKENS, 16, SALT))


def _router(target_s: float, queued_on_b: int = 0) -> RouterCore:
    """A holds the whole prompt behind 6,000 queued tokens (predicted 0.6 s); B holds nothing (0.41 s + its queue)."""
    router = RouterCore(RouterConfig(prefill_weight=8.0, ttft_target_s=target_s))
    for rid, queued in (("A", 6000), ("B", queued_on_b)):
        router.register(ReplicaSpec(rid, "m", prefill_tokens_per_s=10_000.0, decode_round_s=0.0), now=0.0)
        router.mark_ready(rid, now=0.0)
        router.heartbeat(rid, ReplicaLoad(queued_prefill_tokens=queued), now=0.0)
    assert router.apply_kv_events("A", [KvEvent(1, KvEventKind.STORED, CHAIN)], now=0.0)
    return router


def _route(router: RouterCore) -> tuple[str, float]:
    decision = router.route(RouteQuery("q", "m", block_hashes=CHAIN, prompt_tokens=len(TOKENS)), now=0.0)
    return decision.replica_id, decision.predicted_ttft_s


def test_without_a_target_the_weight_sends_the_request_to_its_cache_even_when_late() -> None:
    """Weighted, A's 0.6 s beats B's 0.41 s + 7 x 0.41 s: the request goes to A, predicted past a 0.5 s SLO."""
    replica, ttft = _route(_router(target_s=0.0))
    assert replica == "A" and ttft > 0.5


def test_with_a_target_the_weight_ranks_only_the_replicas_predicted_on_time() -> None:
    """With a 0.5 s target A is predicted late and B on time: B, which admission will not refuse."""
    replica, ttft = _route(_router(target_s=0.5))
    assert replica == "B" and ttft <= 0.5


def test_when_no_replica_is_on_time_the_least_late_wins() -> None:
    """B behind 4,000 queued tokens (0.81 s) and A at 0.6 s are both past 0.5 s: the lowest predicted TTFT, A."""
    replica, ttft = _route(_router(target_s=0.5, queued_on_b=4000))
    assert replica == "A" and 0.5 < ttft < 0.7


def test_the_target_is_set_by_the_router_flag_and_the_simulator_word_and_a_bad_one_is_refused() -> None:
    """`--ttft-target 0.7` and the sim word `on-time` (the report's TTFT SLO) set it; a negative one stops the
    router at start naming the flag."""
    import pytest

    from router_svc.__main__ import parse_args, router_config
    from sluice.serve import StartupError
    from sluice_tools.commands.sim import parse_compare_item
    from sluice_tools.sim import SimConfig

    assert router_config(parse_args(["--ttft-target", "0.7"])).ttft_target_s == 0.7
    assert parse_compare_item("on-time", SimConfig(slo_ttft_s=0.7)).router.ttft_target_s == 0.7
    with pytest.raises(StartupError, match="--ttft-target"):
        router_config(parse_args(["--ttft-target", "-1"]))
