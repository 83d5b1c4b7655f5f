"""Benchmark of KV events with and without token ids: `python -m scheduler_svc.bench_kv_events [--quick]`.

Prefills `requests` distinct 2048-token prompts (128 blocks of 16 each) in rounds of 8192 tokens and
reports, for `kv_event_token_ids` off and on: the CPU time (time.process_time_ns) of `on_round_result`
per registered block (where STORED events are made), and the protobuf bytes per STORED block of the
`kv` stream entry as the replica publishes it (sluice.convert.kv_batch_to_proto). Prints JSON to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from scheduler_svc.core import SchedulerCore
from scheduler_svc.core.config import SchedulerConfig
from sluice import convert
from sluice.types import KvEventKind, NewRequest, RoundResult, SamplingParams, SeqOutput

BLOCK_SIZE = 16
PROMPT = 2048


def _case(token_ids: bool, requests: int, repeats: int) -> dict[str, float]:
    ns_per_block: list[float] = []
    bytes_per_block = 0.0
    for repeat in range(repeats):
        core = SchedulerCore(SchedulerConfig(
            num_blocks=requests * (PROMPT // BLOCK_SIZE + 2), block_size=BLOCK_SIZE, max_num_batched_tokens=8192,
            max_num_seqs=requests, max_prefill_chunk=PROMPT, max_model_len=PROMPT + 8,
            kv_event_token_ids=token_ids))
        for i in range(requests):
            prompt = tuple((repeat * 7919 + i * PROMPT + t) % 50_000 for t in range(PROMPT))
            core.submit(NewRequest(f"r{i}", prompt, SamplingParams(max_tokens=1)), 0.0)
        spent, stored, size = 0, 0, 0
        now = 1.0
        while core.has_unfinished():
            plan = core.schedule(now)
            result = RoundResult(plan.round_id, tuple(SeqOutput(s.request_id, s.epoch, (1,) if s.sample else ())
                                                      for s in plan.seqs))
            start = time.process_time_ns()
            events = core.on_round_result(result, now)
            spent += time.process_time_ns() - start
            blocks = sum(len(e.block_hashes) for e in events.kv_events if e.kind is KvEventKind.STORED)
            stored += blocks
            if blocks:
                batch = convert.kv_batch_to_proto("replica-0", events.kv_events, block_size=BLOCK_SIZE, ts=now)
                size += batch.ByteSize()
            now += 1.0
        ns_per_block.append(spent / stored)
        bytes_per_block = size / stored
    return {"on_round_result_ns_per_stored_block_median": statistics.median(ns_per_block),
            "wire_bytes_per_stored_block": round(bytes_per_block, 1)}


def main(argv: list[str] | None = None) -> int:
    """Run both cases and print their figures as JSON; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="3 repeats of 16 requests instead of 7 of 64")
    args = parser.parse_args(argv)
    requests, repeats = (16, 3) if args.quick else (64, 7)
    report = {"block_size": BLOCK_SIZE, "prompt_tokens": PROMPT, "requests": requests, "repeats": repeats,
              "token_ids_off": _case(False, requests, repeats), "token_ids_on": _case(True, requests, repeats)}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
