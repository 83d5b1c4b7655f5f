"""`dynamo_kv`'s overlap scores against Dynamo's own indexer (`ai-dynamo-runtime`'s `RadixTree.find_matches`).

One event stream in vLLM's shapes (BlockStored with vLLM's block ids, parents and token ids, BlockRemoved on
eviction, AllBlocksCleared on a cache reset) from three simulated engines is fed to both: to Sluice through the
path a live engine's events take (the agent's `decode_event` + `KvTranslator`, then `RouterCore.apply_kv_events`)
and to Dynamo's `RadixTree` in a subprocess of the Dynamo venv (`tests/integration/dynamo_radix_oracle.py`). At
many points of the stream both are asked the same queries; the per-worker matched blocks must be equal.

The Dynamo venv is `.venv-peers/dynamo` (`make setup-dynamo`, part of `make setup`), or $SLUICE_DYNAMO_PYTHON.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections import OrderedDict
from pathlib import Path
from typing import Any

from router_svc.competitors import DynamoKv
from router_svc.core import ReplicaSpec, RouterConfig, RouterCore, RoutingPolicy
from scheduler_svc.engines.vllm.hashing import chain, event_id
from scheduler_svc.engines.vllm.kv import KvTranslator, decode_event
from sluice.hashing import hash_chain, salt_of

ROOT = Path(__file__).resolve().parents[2]
ORACLE = Path(__file__).with_name("dynamo_radix_oracle.py")
BLOCK = 32
"""vLLM's block size on CPU (a multiple of 32)."""
MODEL = "tiny"
WORKERS = 3


def dynamo_python() -> str:
    """The Dynamo venv's python: $SLUICE_DYNAMO_PYTHON, else `.venv-peers/dynamo` in the repo; a clear
    FileNotFoundError naming the make target otherwise (the check must run, not be skipped)."""
    path = os.environ.get("SLUICE_DYNAMO_PYTHON") or str(ROOT / ".venv-peers" / "dynamo" / "bin" / "python")
    if not Path(path).exists():
        raise FileNotFoundError(f"no Dynamo venv at {path}: run `make setup-dynamo` (part of `make setup`)")
    return path


class SimulatedEngine:
    """One vLLM engine's prefix cache as its KV events describe it: full blocks stored on a request (several
    BlockStored when its prefill is chunked), the least recently used leaf blocks evicted first when full
    (children before their parents, as vLLM's free queue orders them), everything cleared on a reset."""

    def __init__(self, capacity_blocks: int, rng: random.Random) -> None:
        self.capacity, self.rng = capacity_blocks, rng
        self.blocks: OrderedDict[int, int | None] = OrderedDict()
        """vLLM id -> parent id, least recently used first."""
        self.children: dict[int, int] = {}

    def serve(self, tokens: list[int]) -> list[dict[str, Any]]:
        """Return the events of serving `tokens` (prompt and generated tokens)."""
        ids = [event_id(d) for d in chain(tokens, BLOCK, "sha256_cbor")]
        held = 0
        while held < len(ids) and ids[held] in self.blocks:
            self.blocks.move_to_end(ids[held])
            held += 1
        new = ids[held:]
        events = self._evict(len(self.blocks) + len(new) - self.capacity, keep=set(ids[:held]))
        start = held
        while start < len(ids):
            end = min(len(ids), start + self.rng.randint(1, 4))
            parent = ids[start - 1] if start else None
            events.append({"type": "BlockStored", "block_hashes": ids[start:end], "parent_block_hash": parent,
                           "token_ids": tokens[start * BLOCK:end * BLOCK], "block_size": BLOCK, "lora_id": None,
                           "medium": "GPU", "lora_name": None})
            for index in range(start, end):
                self.blocks[ids[index]] = ids[index - 1] if index else None
                if index:
                    self.children[ids[index - 1]] = self.children.get(ids[index - 1], 0) + 1
            start = end
        return events

    def clear(self) -> list[dict[str, Any]]:
        """Return the event of a prefix-cache reset."""
        self.blocks.clear()
        self.children.clear()
        return [{"type": "AllBlocksCleared"}]

    def _evict(self, count: int, keep: set[int]) -> list[dict[str, Any]]:
        removed: list[int] = []
        while len(removed) < count:
            victim = next((b for b in self.blocks if not self.children.get(b) and b not in keep), None)
            if victim is None:
                break
            parent = self.blocks.pop(victim)
            if parent is not None:
                self.children[parent] -= 1
            removed.append(victim)
        events: list[dict[str, Any]] = []
        while removed:  # vLLM batches a step's evictions; split them at random
            cut = self.rng.randint(1, len(removed))
            events.append({"type": "BlockRemoved", "block_hashes": removed[:cut], "medium": "GPU"})
            removed = removed[cut:]
        return events


def make_prompts(rng: random.Random) -> list[list[int]]:
    """Prompts with shared structure: 4 system prompts, conversations that extend their own history."""
    systems = [[rng.randrange(256) for _ in range(rng.choice((64, 96, 160)))] for _ in range(4)]
    prompts = []
    for _ in range(30):
        history = list(rng.choice(systems))
        for _ in range(rng.randint(1, 4)):
            history += [rng.randrange(256) for _ in range(rng.randint(20, 120))]
            prompts.append(list(history))
    return prompts


def queries(rng: random.Random, prompts: list[list[int]], count: int) -> list[list[int]]:
    """Whole prompts, cut prompts, prompts with a new tail, and unrelated ones."""
    out = []
    for _ in range(count):
        base = list(rng.choice(prompts))
        shape = rng.random()
        if shape < 0.3:
            base = base[: rng.randint(1, len(base))]
        elif shape < 0.7:
            base += [rng.randrange(256) for _ in range(rng.randint(1, 100))]
        elif shape < 0.8:
            base = [rng.randrange(256) for _ in range(rng.randint(1, 200))]
        out.append(base)
    return out


def sluice_overlaps(router: RouterCore, tokens: list[int]) -> dict[str, int]:
    """`dynamo_kv`'s overlap per worker (its `cached` callable on the router's index), the nonzero ones."""
    policy = router.policy
    assert isinstance(policy, DynamoKv)
    hashes = tuple(hash_chain(tokens, BLOCK, salt_of(MODEL)))
    scores = {str(w): policy.cached(router.fleet.get(f"w{w}").cache, hashes, 0.0) for w in range(WORKERS)}
    return {w: n for w, n in scores.items() if n}


def test_dynamo_kv_overlap_equals_dynamo_radix_tree_on_one_event_stream() -> None:
    """Over 1,500 queries asked at 50 points of a stream of stores, evictions and resets on 3 workers, the
    matched blocks per worker of `dynamo_kv` (Sluice's index fed through the vLLM agent's translation) equal
    those of Dynamo's RadixTree.find_matches, and the stream exercised every kind of event and real overlaps."""
    rng = random.Random(21)
    router = RouterCore(RouterConfig(policy=RoutingPolicy.DYNAMO_KV, prediction_ttl_s=0.0))
    translators, engines = [], []
    for w in range(WORKERS):
        router.register(ReplicaSpec(f"w{w}", MODEL, num_blocks=60, block_size=BLOCK), now=0.0)
        router.mark_ready(f"w{w}", now=0.0)
        translators.append(KvTranslator(MODEL, BLOCK))
        engines.append(SimulatedEngine(60, rng))
    prompts = make_prompts(rng)
    lines: list[str] = []
    expected: list[dict[str, int]] = []
    kinds: dict[str, int] = {}
    for _point in range(50):
        for _ in range(12):
            w = rng.randrange(WORKERS)
            engine = engines[w]
            prompt = rng.choice(prompts)
            served = engine.clear() if rng.random() < 0.02 else engine.serve(
                prompt + [rng.randrange(256) for _ in range(rng.randint(1, 64))])
            for raw in served:
                kinds[raw["type"]] = kinds.get(raw["type"], 0) + 1
                lines.append(json.dumps({"worker": w, "event": raw}))
                decoded = decode_event(raw)
                assert decoded is not None
                assert router.apply_kv_events(f"w{w}", translators[w].translate([decoded]), now=0.0)
        for tokens in queries(rng, prompts, 30):
            lines.append(json.dumps({"query": tokens, "block_size": BLOCK}))
            expected.append(sluice_overlaps(router, tokens))
    done = subprocess.run([dynamo_python(), str(ORACLE)], input="\n".join(lines) + "\n", capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    dynamo = [json.loads(line)["scores"] for line in done.stdout.splitlines()]
    assert len(dynamo) == len(expected) == 1500
    mismatches = [(i, ours, theirs) for i, (ours, theirs) in enumerate(zip(expected, dynamo, strict=True))
                  if ours != theirs]
    assert not mismatches, f"{len(mismatches)} of 1500 differ, first: {mismatches[:3]}"
    assert kinds.get("BlockRemoved", 0) > 50 and kinds.get("AllBlocksCleared", 0) >= 3, kinds
    assert sum(1 for s in expected if s) > 500, "too few queries matched anything to prove the scores"
    assert sum(1 for s in expected if len(set(s.values())) > 1) > 100, "too few queries told workers apart"
    assert all(t.untranslated_blocks == 0 for t in translators)
