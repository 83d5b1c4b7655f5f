"""The short chaos run of `make test`: processes killed -9 and stalled under a mixed load; the invariants hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice_tools.chaos import ChaosConfig, run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


def test_a_short_chaos_run_ends_every_request_once_exact_or_explicit_and_leaks_nothing(tmp_path: Path) -> None:
    """25 s of a two-tenant mixed load (cancels included), over gRPC and over the OpenAI HTTP API (streams whose
    chunks the token reader writes at once), while a worker, scheduler, router, admission or Redis is killed -9,
    or Redis or a scheduler stalled, every 3 s under supervision: no request hung, no token (no character of
    text) that is not the model's, no HTTP stream cut off while admission lived, some requests exact on both
    APIs, and afterwards nothing reserved in admission, nothing queued, running or in KV on a scheduler,
    nothing pending in Redis."""
    report = run(ChaosConfig(duration_s=25, fault_interval_s=3, clients=3, http_clients=2, seed=7,
                             run_dir=str(tmp_path)))
    print("\n" + json.dumps({k: v for k, v in report.items() if k not in ("config", "rss_kb_start")}))
    assert report["faults_injected"] >= 6
    assert (report["hung"], report["wrong_tokens"]) == (0, 0), report["examples"]
    assert report["exact"] >= 1 and report["offered"] >= report["exact"]
    assert report["http_outcomes"].get("exact", 0) >= 1 and report["exact"] > report["http_outcomes"]["exact"]
    assert report["leaks"] == {"admission_reserved": {}, "scheduler_requests": 0, "kv_blocks_used": 0,
                               "kv_blocks_held": 0, "host_blocks_beyond_tier": 0, "redis_pending": {}}
    assert report["ok"]


def test_a_chaos_run_with_the_host_prefix_tier_loses_nothing_and_holds_no_host_block(tmp_path: Path) -> None:
    """15 s of the mixed load on replicas with a host prefix tier (64 device blocks, so prompts are evicted and paged
    out; half the prompts from 4 long shared ones, so they come back from the tier) while workers and schedulers, where the tier's
    copies and ledgers live, are killed -9 or stalled (3 s) every 2.5 s: the tier was used (host hits), no request hung,
    no token that is not the model's, and afterwards no device block and no host block beyond the tier's copies is
    held, nothing reserved, nothing pending."""
    report = run(ChaosConfig(duration_s=15, fault_interval_s=2.5, clients=3, seed=11, host_tier=True,
                             faults=("kill:worker", "kill:scheduler", "stop:scheduler"), run_dir=str(tmp_path)))
    print("\n" + json.dumps({k: v for k, v in report.items() if k not in ("config", "rss_kb_start")}))
    assert report["faults_injected"] >= 3 and set(report["fault_kinds"]) <= {"kill:worker", "kill:scheduler",
                                                                             "stop:scheduler"}
    assert report["host_tier"] and report["host_hit_tokens"] > 0
    assert (report["hung"], report["wrong_tokens"]) == (0, 0), report["examples"]
    assert report["exact"] >= 1 and report["offered"] >= report["exact"]
    assert report["leaks"] == {"admission_reserved": {}, "scheduler_requests": 0, "kv_blocks_used": 0,
                               "kv_blocks_held": 0, "host_blocks_beyond_tier": 0, "redis_pending": {}}
    assert report["ok"]
