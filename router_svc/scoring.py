"""How the router chooses among READY replicas: policies as small classes behind `RoutingPolicy`.

Score (policy SCORE) = predicted time to first token on that replica (`predict_ttft`)
  = queue wait (queued prefill tokens, reported and routed since, / prefill rate)
  + prefill time of the uncached part
  + decode interference (one decode round per prefill chunk while the replica has running decodes).
Measured rates (heartbeats) win over the ones the replica registered with. The minimum wins;
replicas within `tie_tolerance_s` of it are tie-broken at random (seeded), so routers with the
same stale view do not all herd onto one replica. The baselines (ROUND_ROBIN, RANDOM,
LEAST_LOADED, PREFIX_ONLY) and the competitors a user would pick instead (DYNAMO_KV, LLM_D, in
router_svc.competitors) are there to be compared with it.

`make_policy` builds one from its enum member or name; an unknown name raises ValueError listing
the known ones. SCORE's `load_bound` (above 1) first drops the replicas whose request count is at
the bounded-loads cap (`within_load_bound`), so a hot prefix spills over instead of herding. With a
prefill weight and a `ttft_target_s`, the weight ranks only the replicas predicted on time (the
least late wins when none is), so a cache hit never costs a request its TTFT SLO.
Pure: no clock, no I/O.
"""

from __future__ import annotations

import enum
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from router_svc.fleet import Replica, ReplicaSpec
from router_svc.prefix_index import ReplicaCache
from sluice.choices import enum_member

__all__ = [
    "LeastLoaded", "PrefixOnly", "RandomChoice", "ReplicaPolicy", "RoundRobin", "RouteDecision", "RouteQuery",
    "RoutingPolicy", "Score", "load_key", "make_policy", "predict_ttft", "within_load_bound",
]


class RoutingPolicy(enum.Enum):
    SCORE = "score"
    """Minimum predicted time to first token (queue wait + uncached prefill + interference)."""
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    LEAST_LOADED = "least_loaded"
    """Fewest waiting + running + routed-in-flight requests."""
    PREFIX_ONLY = "prefix_only"
    """Longest cached prefix, ties to the least loaded (ignores queues: the herding baseline)."""
    DYNAMO_KV = "dynamo_kv"
    """NVIDIA Dynamo's KV router cost (router_svc.competitors.DynamoKv), its default weight and temperature."""
    LLM_D = "llm_d"
    """llm-d's default weighted scorers (router_svc.competitors.LlmD): prefix 3, queue 2, KV utilisation 2."""

    @property
    def uses_prefix(self) -> bool:
        """Return True when the policy reads the prefix index (the caller must hash prompts)."""
        return self not in (RoutingPolicy.ROUND_ROBIN, RoutingPolicy.RANDOM, RoutingPolicy.LEAST_LOADED)

    @classmethod
    def parse(cls, name: str) -> RoutingPolicy:
        """Return the policy named `name`; raises ValueError listing the known names."""
        return enum_member(cls, name, "routing policy")


@dataclass(frozen=True)
class RouteQuery:
    request_id: str
    model: str
    adapter_version: str = ""
    block_hashes: tuple[int, ...] = ()
    prompt_tokens: int = 0
    max_tokens: int = 0
    tenant: str = ""
    dry_run: bool = False
    """Predict only: route() records nothing (RouteRequest.dry_run)."""


@dataclass(frozen=True)
class RouteDecision:
    replica_id: str
    address: str
    predicted_ttft_s: float
    queue_wait_s: float
    prefill_s: float
    cached_blocks: int


CachedBlocks = Callable[[ReplicaCache, tuple[int, ...], float], int]
"""(replica cache, block hashes, now) -> cached prefix in blocks (PrefixIndex.cached)."""


def predict_ttft(replica: Replica, query: RouteQuery, cached: int) -> tuple[float, float, float]:
    """Return (predicted TTFT, queue wait, prefill time) of `query` on `replica`; the hot loop of SCORE.

    Queue wait: the queued prefill tokens (reported and routed since) at the prefill rate; while the
    replica runs requests, plus one decode round per chunk of that queue (every round carries the
    decodes) and 1.5 rounds for the rounds in flight, whose tokens the queue no longer counts
    (pipelining: a request arriving mid-round is first planned in the round after next; half the
    current round is left on average). Prefill: the uncached tokens at the rate plus their attention
    to the whole prompt (`prefill_pair_s` per pair). The TTFT adds what the prefill's rounds take
    beyond that: while decodes run, one decode round per chunk (as many chunks as the scheduler's attention
    charge cuts the prompt into, `prefill_rounds`); on an idle replica, no round is
    shorter than a decode round. A measured rate goes with the measured decode round (it was
    measured net of it), the registered rate with the registered one.
    """
    spec, load = replica.spec, replica.load
    cached_tokens = cached * spec.block_size
    uncached_tokens = max(query.prompt_tokens - cached_tokens, 1)
    if load.prefill_tokens_per_s > 0:  # measured: the rate and the decode round it was measured net of
        rate, decode_round_s = load.prefill_tokens_per_s, load.decode_round_s
    else:
        rate, decode_round_s = (spec.prefill_tokens_per_s if spec.prefill_tokens_per_s > 0 else 1e-9), spec.decode_round_s
    chunk = max(spec.max_num_batched_tokens, 1)
    own_rounds = prefill_rounds(spec, cached_tokens, cached_tokens + uncached_tokens)
    queued = load.queued_prefill_tokens + replica.unreported_tokens
    queue_wait = queued / rate
    prefill = uncached_tokens / rate
    if spec.prefill_pair_s:
        prompt = cached_tokens + uncached_tokens
        prefill += spec.prefill_pair_s * 0.5 * (prompt * prompt - cached_tokens * cached_tokens)
    if load.running or replica.inflight:
        ahead_s = min(queued, chunk) / rate + (load.decode_round_s or spec.decode_round_s)
        queue_wait += -(-queued // chunk) * decode_round_s + 1.5 * ahead_s
        rounds_s = prefill + own_rounds * decode_round_s
    else:
        rounds_s = max(prefill, own_rounds * (load.decode_round_s or spec.decode_round_s))
    return queue_wait + rounds_s, queue_wait, prefill


def prefill_rounds(spec: ReplicaSpec, start: int, end: int) -> int:
    """Return the rounds a prompt's positions [start, end) take in chunks of the replica's token budget B.

    Under the scheduler's attention charge (K pairs per token, C free context) a chunk starting at s > C is at
    most B * K / (K + s - C) tokens (it pays n * (s - C) / K on top of its n), and at least one block, so the
    positions past C take about the integral of (K + s - C) / (B * K) ds: (e - a) / B + ((e - C)^2 - (a - C)^2)
    / (2 * B * K) rounds from a to e. Without the charge, ceil((end - start) / B).
    """
    budget = max(spec.max_num_batched_tokens, 1)
    per_token, free = spec.attention_pairs_per_token, spec.attention_free_context
    if per_token <= 0 or end <= free:
        return -(-(end - start) // budget)
    deep_from = max(start, free)
    shallow = (deep_from - start) / budget
    deep = (end - deep_from) / budget + ((end - free) ** 2 - (deep_from - free) ** 2) / (2 * budget * per_token)
    deep = min(deep, (end - deep_from) / max(spec.block_size, 1))
    return max(math.ceil(shallow + deep - 1e-9), 1)


def load_key(replica: Replica) -> tuple[int, str]:
    """Return the replica's request count (waiting + running + routed in flight), then its id."""
    return (replica.load.waiting + replica.load.running + len(replica.inflight), replica.spec.replica_id)


class ReplicaPolicy(ABC):
    """Interface of every routing policy."""

    @abstractmethod
    def choose(self, ready: list[Replica], query: RouteQuery, now: float) -> Replica:
        """Return one of `ready` (non-empty, sorted by id) for `query`."""


def within_load_bound(ready: list[Replica], bound: float) -> list[Replica]:
    """Return the replicas whose request count is below ceil(bound * (total + 1) / n) (bounded loads).

    Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA 2018): no replica
    takes more than `bound` times the mean, so a hot prefix spills over instead of herding. With the
    counts of `load_key`; never empty (the least loaded is always below the cap).
    """
    counts = [load_key(r)[0] for r in ready]
    cap = math.ceil(bound * (sum(counts) + 1) / len(ready))
    return [r for r, count in zip(ready, counts, strict=True) if count + 1 <= cap]


def within_tenant_spread(ready: list[Replica], tenant: str, spread: int) -> list[Replica]:
    """Return the replicas where one more request of `tenant` leaves them at most `spread` routed requests of
    that tenant ahead of the least one (spread 1: only the replicas that hold fewest).

    Why: each replica orders its own queue by fair share, which adds up to fleet-wide fair share only when
    every replica has every busy tenant queued. Routing by load alone segregates tenants under closed-loop
    load (a finished request frees a seat where its tenant's next request then goes), and a replica holding
    one tenant alone serves it alone: 2:1 weights were served 1.5:1 over two vLLM engines. Never empty."""
    counts = [r.tenant_inflight.get(tenant, 0) for r in ready]
    cap = min(counts) + spread
    return [r for r, count in zip(ready, counts, strict=True) if count + 1 <= cap]


class Score(ReplicaPolicy):
    def __init__(self, cached: CachedBlocks, rng: random.Random, tie_tolerance_s: float,
                 prefill_weight: float, load_bound: float = 0.0, tenant_spread: int = 0,
                 ttft_target_s: float = 0.0) -> None:
        self.cached = cached
        self.rng = rng
        self.tie_tolerance_s = tie_tolerance_s
        self.extra_prefill_weight = prefill_weight - 1.0
        self.load_bound = load_bound
        self.tenant_spread = tenant_spread
        self.ttft_target_s = ttft_target_s

    def choose(self, ready: list[Replica], query: RouteQuery, now: float) -> Replica:
        if self.load_bound >= 1.0 and len(ready) > 1:
            ready = within_load_bound(ready, self.load_bound)
        if self.tenant_spread >= 1 and query.tenant and len(ready) > 1:
            ready = within_tenant_spread(ready, query.tenant, self.tenant_spread)
        cached, hashes, extra = self.cached, query.block_hashes, self.extra_prefill_weight
        if extra:
            scores = self._weighted([predict_ttft(r, query, cached(r.cache, hashes, now)) for r in ready])
        else:
            scores = [predict_ttft(r, query, cached(r.cache, hashes, now))[0] for r in ready]
        limit = min(scores) + self.tie_tolerance_s
        ties = [r for r, score in zip(ready, scores, strict=True) if score <= limit]
        return ties[0] if len(ties) == 1 else ties[self.rng.randrange(len(ties))]

    def _weighted(self, predictions: list[tuple[float, float, float]]) -> list[float]:
        """Return each replica's weighted score from its (TTFT, queue wait, prefill) prediction; with a TTFT
        target, the replicas predicted late score infinity while one is predicted on time, and when none is,
        the plain TTFT ranks them all (the least late wins)."""
        extra, target = self.extra_prefill_weight, self.ttft_target_s
        if target > 0 and not any(ttft <= target for ttft, _, _ in predictions):
            return [ttft for ttft, _, _ in predictions]
        return [ttft + extra * prefill if target <= 0 or ttft <= target else math.inf
                for ttft, _, prefill in predictions]


class RoundRobin(ReplicaPolicy):
    def __init__(self) -> None:
        self.counter = 0

    def choose(self, ready: list[Replica], query: RouteQuery, now: float) -> Replica:
        self.counter += 1
        return ready[(self.counter - 1) % len(ready)]


class RandomChoice(ReplicaPolicy):
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choose(self, ready: list[Replica], query: RouteQuery, now: float) -> Replica:
        return ready[self.rng.randrange(len(ready))]


class LeastLoaded(ReplicaPolicy):
    def choose(self, ready: list[Replica], query: RouteQuery, now: float) -> Replica:
        return min(ready, key=load_key)


class PrefixOnly(ReplicaPolicy):
    def __init__(self, cached: CachedBlocks) -> None:
        self.cached = cached

    def choose(self, ready: list[Replica], query: RouteQuery, now: float) -> Replica:
        hashes = query.block_hashes
        return min(ready, key=lambda r: (-self.cached(r.cache, hashes, now), *load_key(r)))


def make_policy(policy: RoutingPolicy | str, *, cached: CachedBlocks, rng: random.Random,
                tie_tolerance_s: float = 0.001, prefill_weight: float = 1.0,
                load_bound: float = 0.0, tenant_spread: int = 0, ttft_target_s: float = 0.0) -> ReplicaPolicy:
    """Return a routing policy for `policy` (an enum member or its value).

    `cached` gives a replica's cached prefix, `rng` breaks ties and drives RANDOM. Raises ValueError
    naming the known policies when `policy` is unknown.
    """
    from router_svc.competitors import DynamoKv, LlmD  # they build on this module's interface

    if not isinstance(policy, RoutingPolicy):
        policy = RoutingPolicy.parse(policy)
    factories: dict[RoutingPolicy, Callable[[], ReplicaPolicy]] = {
        RoutingPolicy.SCORE: lambda: Score(cached, rng, tie_tolerance_s, prefill_weight, load_bound, tenant_spread,
                                           ttft_target_s),
        RoutingPolicy.ROUND_ROBIN: RoundRobin,
        RoutingPolicy.RANDOM: lambda: RandomChoice(rng),
        RoutingPolicy.LEAST_LOADED: LeastLoaded,
        RoutingPolicy.PREFIX_ONLY: lambda: PrefixOnly(cached),
        RoutingPolicy.DYNAMO_KV: lambda: DynamoKv(cached, rng),
        RoutingPolicy.LLM_D: lambda: LlmD(cached, rng),
    }
    return factories[policy]()
