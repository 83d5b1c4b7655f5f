"""Router decision benchmark: 64 replicas, ~1M indexed blocks; prints JSON.

DESIGN.md target: a decision in <= 100 us at p99. Each replica holds its own set of shared-prefix
groups; each query shares a random group's prefix (so replicas really differ in cached length)
and adds a unique suffix.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from router_svc.core import ReplicaLoad, ReplicaSpec, RouteQuery, RouterConfig, RouterCore
from sluice.hashing import hash_chain, salt_of
from sluice.types import KvEvent, KvEventKind


def build(replicas: int, blocks_per_replica: int, groups: int, seed: int) -> tuple[RouterCore, list[list[int]]]:
    rng = random.Random(seed)
    salt = salt_of("llama-3-8b")
    # Shared-prefix groups of 64 blocks (1024 tokens) each.
    prefixes = [hash_chain([rng.randrange(32000) for _ in range(1024)], 16, salt) for _ in range(groups)]
    router = RouterCore(RouterConfig(seed=seed, prediction_ttl_s=0.0))
    for r in range(replicas):
        rid = f"r{r:02d}"
        router.register(ReplicaSpec(rid, "llama-3-8b", prefill_tokens_per_s=20_000), now=0.0)
        router.mark_ready(rid, now=0.0)
        router.heartbeat(rid, ReplicaLoad(queued_prefill_tokens=rng.randrange(50_000)), now=0.0)
        hashes: list[int] = []
        for g in rng.sample(range(groups), k=groups // 4):
            hashes.extend(prefixes[g][: rng.randrange(8, 65)])
        filler = blocks_per_replica - len(hashes)
        hashes.extend(rng.getrandbits(63) | 1 for _ in range(max(filler, 0)))
        router.apply_kv_events(rid, [KvEvent(1, KvEventKind.STORED, tuple(hashes))], now=0.0)
    return router, prefixes


def run(replicas: int, blocks_per_replica: int, queries: int, seed: int) -> dict[str, object]:
    router, prefixes = build(replicas, blocks_per_replica, groups=64, seed=seed)
    rng = random.Random(seed + 1)
    samples_us: list[float] = []
    for i in range(queries):
        chain = tuple(prefixes[rng.randrange(len(prefixes))] + [rng.getrandbits(63) | 1 for _ in range(16)])
        query = RouteQuery(f"q{i}", "llama-3-8b", block_hashes=chain, prompt_tokens=len(chain) * 16)
        start = time.perf_counter_ns()
        decision = router.route(query, now=1.0)
        samples_us.append((time.perf_counter_ns() - start) / 1e3)
        router.on_request_done(decision.replica_id, query.request_id, now=1.0)
    samples_us.sort()
    return {
        "replicas": replicas,
        "indexed_blocks": router.indexed_blocks,
        "queries": queries,
        "decision_us_p50": round(statistics.median(samples_us), 1),
        "decision_us_p99": round(samples_us[int(0.99 * (len(samples_us) - 1))], 1),
        "target_us_p99": 100,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--blocks-per-replica", type=int, default=16_384)
    parser.add_argument("--queries", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="fewer blocks and queries")
    args = parser.parse_args(argv)
    if args.quick:
        args.blocks_per_replica, args.queries = 2048, 1000
    json.dump(run(args.replicas, args.blocks_per_replica, args.queries, args.seed), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
