"""Dynamo's own KV indexer as an oracle: run by the Dynamo venv's python (`ai-dynamo-runtime`), not by the suite's.

Reads JSON lines on stdin, each one of
  {"worker": W, "event": E}   E a vLLM KV event in its map form ({"type": "BlockStored", ...}, "BlockRemoved",
                              "AllBlocksCleared"), fed to `RadixTree.apply_event` the way Dynamo's vLLM publisher
                              does: the vLLM id is the block hash, the block's tokens hashed by
                              `compute_block_hash_for_seq` are its tokens hash;
  {"query": [token ids]}      answered with one line {"scores": {"W": matched blocks, ...}} from `find_matches`
                              on `compute_block_hash_for_seq(tokens, block_size)`.
Imports nothing of Sluice (this venv has Dynamo's dependencies only).
"""

from __future__ import annotations

import json
import sys

from dynamo.llm import RadixTree, compute_block_hash_for_seq


def dynamo_event(event_id: int, event: dict) -> dict:
    """Return Dynamo's form of one vLLM KV event (ids per worker, counting from 1)."""
    kind = event["type"]
    if kind == "BlockStored":
        size, tokens = event["block_size"], event["token_ids"]
        local = compute_block_hash_for_seq(tokens, size)
        blocks = [{"block_hash": h, "tokens_hash": t} for h, t in zip(event["block_hashes"], local, strict=True)]
        data: object = {"stored": {"parent_hash": event.get("parent_block_hash"), "blocks": blocks}}
    elif kind == "BlockRemoved":
        data = {"removed": {"block_hashes": event["block_hashes"]}}
    elif kind == "AllBlocksCleared":
        data = "cleared"
    else:
        raise ValueError(f"unknown vLLM KV event type {kind!r}")
    return {"event_id": event_id, "data": data}


def main() -> int:
    tree = RadixTree()
    event_ids: dict[int, int] = {}
    block_size = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        item = json.loads(line)
        if "event" in item:
            worker, event = int(item["worker"]), item["event"]
            block_size = event.get("block_size", block_size)
            event_ids[worker] = event_ids.get(worker, 0) + 1
            tree.apply_event(worker, json.dumps(dynamo_event(event_ids[worker], event)).encode())
        else:
            scores = tree.find_matches(compute_block_hash_for_seq(item["query"], item["block_size"])).scores
            print(json.dumps({"scores": {str(w): n for (w, _rank), n in scores.items()}}), flush=False)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
